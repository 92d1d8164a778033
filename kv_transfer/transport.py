"""The sender's interface to the KV handoff, and the rules that pick a transport.

    conn = connect("auto", "decode-0:50061", layout, device="cpu")   # handshake, once
    session = conn.begin(lease_id, src_block_ids, dst_block_ids)     # per request
    for layer in range(layout.num_layers):
        ...compute layer...
        session.send_layer(layer, kv_cache)                          # waits only if queue full
    stats = session.commit(timeout=5.0)                              # or session.abort(reason)

| transport | when (auto)                            | data plane                                 |
|-----------|----------------------------------------|--------------------------------------------|
| cuda_ipc  | same host, both KV caches on CUDA      | device-to-device copy into the mapped pool |
| shm       | same host, decode pool in host memory  | memcpy into the mapped shared-memory pool  |
| grpc      | otherwise                              | chunked PushBlocks stream                  |

An explicit choice that cannot work raises TransportRefusedError (a ValueError); there is no
silent fallback. Both ends log the transport in use; `Connection.kind` is the metric label.
The control plane (Begin, LayerDone, Commit, Abort) is the same gRPC service for all three;
shm and cuda_ipc send LayerDone and Commit over the receiver's Unix socket instead when they
reach it (control_client.py; `Connection.control` is "unix" then, else "grpc").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
import weakref
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer import wire
from kv_transfer.control_client import LocalControlClient
from kv_transfer.errors import LayoutMismatchError, TransferError, TransportRefusedError
from kv_transfer.send_options import SenderOptions
from kv_transfer.session import SendSession
from kv_transfer.transports.grpc import GRPC_CHANNEL_OPTIONS, GrpcSendSession
from kv_transfer.transports.one_sided import OneSidedSendSession
from protos.pdserve.internal import kv_transfer_pb2 as pb
from protos.pdserve.internal import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger("pdserve.kv_transfer")

KINDS = wire.KINDS
_AUTO_PREFERENCE = ("cuda_ipc", "shm", "grpc")


def host_id() -> str:
    """A stable id of this machine (and boot): equal ids mean the same kernel, so shm and
    CUDA IPC may work. The env var PDSERVE_HOST_ID overrides it (tests, odd deployments)."""
    return os.environ.get("PDSERVE_HOST_ID") or _machine_host_id()


@functools.cache
def _machine_host_id() -> str:
    parts = []
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id",
                 "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            continue
    if not parts:
        parts.append(socket.gethostname())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _why_not(kind: str, sender_host: str, receiver_host: str, sender_device: str,
             receiver_device: str) -> str | None:
    """Why `kind` cannot work between these two workers, or None if it can."""
    if kind == "grpc":
        return None
    if sender_host != receiver_host:
        return f"sender host {sender_host} != receiver host {receiver_host}"
    sender_cuda = torch.device(sender_device).type == "cuda"
    receiver_cuda = torch.device(receiver_device).type == "cuda"
    if kind == "shm" and receiver_cuda:
        return f"the decode KV pool is on {receiver_device}, not in host shared memory"
    if kind == "cuda_ipc" and not (sender_cuda and receiver_cuda):
        return f"needs CUDA on both sides (sender {sender_device}, receiver {receiver_device})"
    return None


def select_transport(requested: str, sender_host: str, receiver_host: str,
                     sender_device: str, receiver_device: str, *,
                     allowed: Collection[str] = KINDS) -> str:
    """The transport to use: `requested` if it can work (else TransportRefusedError), or for
    "auto" the best that can: cuda_ipc > shm > grpc, among the receiver's `allowed` kinds."""
    if requested not in ("auto", *KINDS):
        raise ValueError(f"unknown transport {requested!r}; choose auto, grpc, shm or cuda_ipc")
    reasons = {kind: _why_not(kind, sender_host, receiver_host, sender_device, receiver_device)
               for kind in KINDS}
    if requested == "auto":
        for kind in _AUTO_PREFERENCE:
            if kind in allowed and reasons[kind] is None:
                return kind
        raise TransportRefusedError(f"no enabled transport works (enabled: {sorted(allowed)}): "
                                    f"{reasons}")
    if reasons[requested] is not None:
        raise TransportRefusedError(f"transport {requested} cannot work: {reasons[requested]}")
    if requested not in allowed:
        raise TransportRefusedError(f"transport {requested} is not enabled on the receiver "
                                    f"(enabled: {sorted(allowed)})")
    return requested


class Connection:
    """A prefill worker's link to one decode worker: the gRPC control channel plus the data
    plane chosen at handshake. Thread-safe; open any number of sessions on it."""

    def __init__(self, target: str, layout: KVLayout, kind: str, reply: pb.HandshakeResponse,
                 channel: grpc.Channel, options: SenderOptions, dst: torch.Tensor | None,
                 keepalive: object = None, local: LocalControlClient | None = None) -> None:
        self.target, self.layout, self.kind = target, layout, kind
        # the one-sided transport "auto" chose but could not map here ("" when none failed)
        self.fallback_from = ""
        # where LayerDone and Commit go: "unix" (the receiver's socket) or "grpc"
        self.control = "unix" if local is not None else "grpc"
        self._local = local
        self.receiver_host_id = reply.receiver_host_id
        self.receiver_device = reply.receiver_device
        self.num_blocks = reply.num_blocks  # blocks in the receiver's pool
        # the receiver process handshaken with: Begin carries it, a restarted one refuses
        self.receiver_instance = reply.receiver_instance
        self.options = options
        self._channel = channel
        self._stub = pb_grpc.KVTransferStub(channel)
        self._dst = dst  # the receiver's pool mapped here (shm, cuda_ipc), else None
        self._keepalive = keepalive  # owns the mapping of _dst (e.g. a SharedKVPool)
        self._sessions: weakref.WeakSet[SendSession] = weakref.WeakSet()
        self._lock = threading.Lock()  # begin (engine thread) against close (event loop)
        self._closed = False

    def begin(self, lease_id: str, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int]) -> SendSession:
        """Start the transfer of one lease: src_block_ids[i] of the local cache goes to
        dst_block_ids[i] of the receiver's (the lease's blocks, in the lease's order)."""
        if len(src_block_ids) != len(dst_block_ids) or not dst_block_ids:
            raise ValueError(f"need as many source as destination blocks (and at least one), "
                             f"got {len(src_block_ids)} and {len(dst_block_ids)}")
        if len(set(dst_block_ids)) != len(dst_block_ids):
            raise ValueError(f"destination blocks repeat: {list(dst_block_ids)}")
        if not all(0 <= b < self.num_blocks for b in dst_block_ids):
            raise ValueError(f"destination blocks must be in [0, {self.num_blocks})")
        args = (self._stub, self.layout, lease_id, src_block_ids, dst_block_ids, self.options,
                self.receiver_instance)
        with self._lock:
            if self._closed:  # another transfer's failure closed it: the receiver may be gone
                raise TransferError(f"the connection to {self.target} was closed after a "
                                    f"failed transfer; handshake again")
            if self.kind == "grpc":
                session: SendSession = GrpcSendSession(*args)
            else:
                session = OneSidedSendSession(*args, dst=self._dst, kind=self.kind,
                                              local=self._local)
            self._sessions.add(session)
        return session.start()

    def close(self) -> None:
        """Abort the sessions still running, then close the channel and unmap the pool; a
        later begin() raises TransferError."""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions)
        for session in sessions:
            session.abort("connection closed")
        for session in sessions:  # a committed one may still be dropping its snapshots
            session.join(self.options.rpc_timeout_s)
        if self._local is not None:
            self._local.close()
        self._channel.close()
        self._dst = self._keepalive = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(kind: str, target: str, layout: KVLayout, *, device: str = "cpu",
            options: SenderOptions | None = None,
            credentials: grpc.ChannelCredentials | None = None,
            channel_options: Sequence[tuple[str, str]] = ()) -> Connection:
    """Handshake with the decode worker at `target` ("host:port") and set up the data plane.
    kind: "auto" | "grpc" | "shm" | "cuda_ipc"; device: where the sender's KV cache lives;
    credentials: TLS for the control plane and the grpc transport (None: plaintext).
    "auto" falls back to grpc when the one-sided transport it chose cannot map the receiver's
    pool here (same host and boot, but separate /dev/shm mounts or GPUs this process cannot
    reach: containers that share a kernel and nothing else).
    Raises LayoutMismatchError, TransportRefusedError, or TransferError (unreachable)."""
    options = options or SenderOptions()
    wire.kind_to_proto(kind)  # ValueError for an unknown kind
    if kind == "cuda_ipc" and not torch.cuda.is_available():
        raise TransportRefusedError("transport cuda_ipc cannot work: no CUDA in the sender")
    me = host_id()
    opts = [*GRPC_CHANNEL_OPTIONS.items(), *channel_options]
    channel = (grpc.insecure_channel(target, options=opts) if credentials is None
               else grpc.secure_channel(target, credentials, options=opts))
    try:
        reply = pb_grpc.KVTransferStub(channel).Handshake(pb.HandshakeRequest(
            layout=wire.layout_to_proto(layout), transport=wire.kind_to_proto(kind),
            sender_host_id=me, sender_device=str(device),
            protocol_version=wire.PROTOCOL_VERSION), timeout=options.rpc_timeout_s)
        # a receiver older than the field cannot refuse a newer sender: the sender does
        if mismatch := wire.protocol_mismatch(wire.PROTOCOL_VERSION, reply.protocol_version):
            raise LayoutMismatchError(mismatch)
        if reply.layout_fingerprint != layout.fingerprint():  # a field the proto lacks
            raise LayoutMismatchError([f"fingerprint: {layout.fingerprint()!r} != "
                                       f"{reply.layout_fingerprint!r}"])
        chosen = wire.kind_from_proto(reply.transport)
        # Never trust a choice we would not have made: same rules, our side of the facts.
        if select_transport(kind, me, reply.receiver_host_id, str(device),
                            reply.receiver_device, allowed=(chosen,)) != chosen:
            raise TransportRefusedError(f"receiver chose {chosen}, the sender would not")
        try:
            dst, keepalive = _attach(chosen, reply, layout)
        except TransportRefusedError as e:
            if kind != "auto":
                raise
            log.warning("kv transfer to %s: %s cannot map the receiver's pool here (%s); "
                        "using grpc", target, chosen, e)
            channel.close()
            conn = connect("grpc", target, layout, device=device, options=options,
                           credentials=credentials, channel_options=channel_options)
            conn.fallback_from = chosen
            return conn
    except grpc.RpcError as e:
        channel.close()
        if e.code() is grpc.StatusCode.FAILED_PRECONDITION:
            mismatch = LayoutMismatchError.from_message(e.details() or "")
            raise mismatch or TransportRefusedError(e.details()) from None
        raise TransferError(f"handshake with {target} failed: {e.code().name}: {e.details()}",
                            e.code().name) from None
    except BaseException:
        channel.close()
        raise
    options = replace(options, chunk_bytes=min(options.chunk_bytes, reply.max_chunk_bytes))
    local = _open_local_control(chosen, reply, options, target)
    log.info("kv transfer to %s uses %s, control over %s (requested %s; sender host %s on %s, "
             "receiver host %s on %s)", target, chosen, "unix" if local else "grpc", kind, me,
             device, reply.receiver_host_id, reply.receiver_device)
    return Connection(target, layout, chosen, reply, channel, options, dst, keepalive, local)


def _open_local_control(kind: str, reply: pb.HandshakeResponse, options: SenderOptions,
                        target: str) -> LocalControlClient | None:
    """The receiver's same-host control socket, if this one-sided connection can use it."""
    if kind == "grpc" or not options.local_control or not reply.local_control_path:
        return None
    try:
        return LocalControlClient.open(reply.local_control_path, reply.receiver_instance,
                                       options.rpc_timeout_s)
    except TransportRefusedError as e:
        log.warning("kv transfer to %s: control stays on grpc (%s)", target, e)
        return None


def _attach(kind: str, reply: pb.HandshakeResponse, layout: KVLayout):
    """Map the receiver's pool for one-sided transports: (tensor, owner of the mapping)."""
    if kind == "shm":
        from kv_transfer.transports.shm import SharedKVPool

        pool = SharedKVPool.attach(reply.shm.path, layout, reply.num_blocks,
                                   identity=(reply.shm.st_dev, reply.shm.st_ino))
        return pool.tensor, pool
    if kind == "cuda_ipc":
        from kv_transfer.transports.cuda_ipc import handle_from_proto, open_handle

        handle = handle_from_proto(reply.cuda_ipc)
        try:
            pool = open_handle(handle, layout, reply.num_blocks)
        except (RuntimeError, OSError) as e:  # torch's cudaIpcOpenMemHandle or ref-counter file
            raise TransportRefusedError(
                f"cuda_ipc cannot open the receiver's pool (GPU {handle.device_index}) here: "
                f"{e}; the workers must share /dev/shm and see each other's GPUs") from e
        return pool, pool
    return None, None
