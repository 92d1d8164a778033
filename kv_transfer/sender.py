"""The sender's side of the KV handoff (the prefill worker's): connect() handshakes with one
decode worker, and the Connection opens a session per request.

    conn = connect("auto", "decode-0:50061", layout, device="cpu")   # handshake, once
    session = conn.begin(lease_id, src_block_ids, dst_block_ids)     # per request
    for layer in range(layout.num_layers):
        ...compute layer...
        session.send_layer(layer, kv_cache)                          # waits only if queue full
    stats = session.commit(timeout=5.0)                              # or session.abort(reason)

The receiver picks the transport (negotiation.py) and this side checks the pick; the chosen
transport (transports/) maps the receiver's pool here if it is one-sided and makes each
session. An explicit choice that cannot work raises TransportRefusedError (a ValueError);
there is no silent fallback. Both ends log the transport in use; `Connection.kind` is the
metric label. The control plane (Begin, LayerDone, Commit, Abort) is the same gRPC service
for every transport; one-sided ones send LayerDone and Commit over the receiver's Unix socket
instead when they reach it (control_client.py; `Connection.control` is "unix" then, else
"grpc"). Nothing here imports the receiver's side (kv_transfer/receiver/).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace

import grpc
import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer import transports, wire
from kv_transfer.control_client import LocalControlClient
from kv_transfer.errors import LayoutMismatchError, TransferError, TransportRefusedError
from kv_transfer.grpc_options import GRPC_CHANNEL_OPTIONS
from kv_transfer.negotiation import host_id, kind_from_proto, kind_to_proto, select_transport
from kv_transfer.send_options import SenderOptions, SendState
from kv_transfer.session import SendSession
from kv_transfer.transports.base import Transport
from protos.pdserve.internal import kv_transfer_pb2 as pb
from protos.pdserve.internal import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger("pdserve.kv_transfer")


class Connection:
    """A prefill worker's link to one decode worker: the gRPC control channel plus the data
    plane chosen at handshake. Thread-safe; open any number of sessions on it."""

    def __init__(self, target: str, layout: KVLayout, transport: Transport,
                 reply: pb.HandshakeResponse, channel: grpc.Channel, options: SenderOptions,
                 dst: torch.Tensor | None, local: LocalControlClient | None = None) -> None:
        self.target, self.layout, self.transport = target, layout, transport
        self.kind = transport.name
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
        self._dst = dst  # the receiver's pool mapped here (one-sided transports), else None
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
            session = self.transport.new_session(*args, pool=self._dst, local=self._local)
            self._sessions.add(session)
        return session.start()

    @property
    def num_active(self) -> int:
        """Sessions begun and not yet ended (sending layers, or committed and waiting for
        the receiver's verdict)."""
        with self._lock:
            return sum(s.state in (SendState.SENDING, SendState.COMMITTING)
                       for s in self._sessions)

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
        self._dst = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(kind: str, target: str, layout: KVLayout, *, device: str = "cpu",
            options: SenderOptions | None = None,
            credentials: grpc.ChannelCredentials | None = None,
            channel_options: Sequence[tuple[str, str]] = ()) -> Connection:
    """Handshake with the decode worker at `target` ("host:port") and set up the data plane.
    kind: "auto" or a transport's name; device: where the sender's KV cache lives;
    credentials: TLS for the control plane and the grpc transport (None: plaintext).
    "auto" falls back to grpc when the one-sided transport it chose cannot map the receiver's
    pool here (same host and boot, but separate /dev/shm mounts or GPUs this process cannot
    reach: containers that share a kernel and nothing else).
    Raises LayoutMismatchError, TransportRefusedError, or TransferError (unreachable)."""
    options = options or SenderOptions()
    requested = kind_to_proto(kind)  # ValueError for an unknown kind
    if kind != "auto" and (reason := transports.get(kind).sender_refusal(str(device))):
        raise TransportRefusedError(f"transport {kind} cannot work: {reason}")
    me = host_id()
    opts = [*GRPC_CHANNEL_OPTIONS.items(), *channel_options]
    channel = (grpc.insecure_channel(target, options=opts) if credentials is None
               else grpc.secure_channel(target, credentials, options=opts))
    try:
        reply = pb_grpc.KVTransferStub(channel).Handshake(pb.HandshakeRequest(
            layout=wire.layout_to_proto(layout), transport=requested,
            sender_host_id=me, sender_device=str(device),
            protocol_version=wire.PROTOCOL_VERSION), timeout=options.rpc_timeout_s)
        # a receiver older than the field cannot refuse a newer sender: the sender does
        if mismatch := wire.protocol_mismatch(wire.PROTOCOL_VERSION, reply.protocol_version):
            raise LayoutMismatchError(mismatch)
        if reply.layout_fingerprint != layout.fingerprint():  # a field the proto lacks
            raise LayoutMismatchError([f"fingerprint: {layout.fingerprint()!r} != "
                                       f"{reply.layout_fingerprint!r}"])
        chosen = kind_from_proto(reply.transport)
        # Never trust a choice we would not have made: same rules, our side of the facts.
        if select_transport(kind, me, reply.receiver_host_id, str(device),
                            reply.receiver_device, allowed=(chosen,)) != chosen:
            raise TransportRefusedError(f"receiver chose {chosen}, the sender would not")
        transport = transports.get(chosen)
        try:
            dst = transport.attach(reply, layout)
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
    local = _open_local_control(transport, reply, options, target)
    log.info("kv transfer to %s uses %s, control over %s (requested %s; sender host %s on %s, "
             "receiver host %s on %s)", target, chosen, "unix" if local else "grpc", kind, me,
             device, reply.receiver_host_id, reply.receiver_device)
    return Connection(target, layout, transport, reply, channel, options, dst, local)


def _open_local_control(transport: Transport, reply: pb.HandshakeResponse,
                        options: SenderOptions, target: str) -> LocalControlClient | None:
    """The receiver's same-host control socket, if this one-sided connection can use it."""
    if not transport.is_one_sided or not options.local_control or not reply.local_control_path:
        return None
    try:
        return LocalControlClient.open(reply.local_control_path, reply.receiver_instance,
                                       options.rpc_timeout_s, reply.local_control_begin)
    except TransportRefusedError as e:
        log.warning("kv transfer to %s: control stays on grpc (%s)", target, e)
        return None

