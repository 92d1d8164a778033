"""The decode worker's end of the KV handoff: handshake checks, writes on receipt, verification.

Transport-agnostic and free of gRPC: servicer.py turns protobuf into these calls and errors
into status codes. Every method is thread-safe. commit() may wait for checksums, so the
servicer runs it in a worker thread, off the event loop, unless commit_is_quick() says only
a short check is left.

    handshake    layouts equal? transport possible and enabled? -> kind + data-plane endpoint
    begin        a lease's sender arrives (LeaseTable.begin checks the blocks)
    write_chunk  grpc: bytes land in the lease's blocks on receipt, under the lease table lock
    layer_done   a layer is complete: its checksum is recorded, and the checksum of its
                 destination blocks is queued on the verifier thread at once
    commit       RECEIVING -> VERIFYING -> COMPLETE | FAILED: destination vs sender checksums
    abort        either side; idempotent

Each layer is verified as it arrives: while a prefill computes its later layers, the decode
worker checks the earlier ones, and commit only collects the verdicts (waiting for checks
still queued) and checks what was never reported done (a one-sided sender's last layer comes
with the commit). The handoff so adds the last layer's check to the time to first token, not
every layer's. A layer's bytes are final once its sender reports it done (a one-sided sender
writes them before LayerDone; grpc chunks arrive before their layer_done on the same stream),
so the bytes checked are the bytes the decode steps read.

A reaper thread expires leases past their deadline every `reap_interval_s` seconds (verbs
also expire a lease they find overdue, so the reaper only bounds how late a release comes).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer import transports, wire
from kv_transfer.blocks import block_rows
from kv_transfer.checksum import checksum_blocks_as
from kv_transfer.errors import LayoutMismatchError, TransportRefusedError, VerificationError
from kv_transfer.lease import LeaseTable
from kv_transfer.negotiation import host_id, select_transport
from kv_transfer.send_options import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from kv_transfer.transports.base import ReceiverPool
from kv_transfer.transports.shm import SharedKVPool

log = logging.getLogger("pdserve.kv_transfer")

# commit() checks at most this many bytes on the host on the gRPC event loop (commit_is_quick)
QUICK_HOST_CHECK_BYTES = 4 << 20


@dataclass(frozen=True)
class HandshakeResult:
    kind: str  # the transport chosen for this sender
    export: object | None  # what the sender needs to reach the pool (Transport.export)


@dataclass(frozen=True)
class CommitResult:
    num_bytes_verified: int
    verify_seconds: float  # commit's own time: collecting the verdicts, checking what was left


class KVReceiver:
    """Receives KV for the leases of `lease_table` into `kv_cache`
    [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim] (contiguous)."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, lease_table: LeaseTable,
                 allowed_kinds: Iterable[str] | None = None, *,
                 shm_pool: SharedKVPool | None = None, host: str | None = None,
                 max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, reap_interval_s: float = 0.1):
        if (kv_cache.dim() != 6 or tuple(kv_cache.shape) != layout.cache_shape(kv_cache.shape[1])
                or kv_cache.dtype != layout.torch_dtype or not kv_cache.is_contiguous()):
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} is not a "
                             f"contiguous cache of {layout}")
        if shm_pool is not None and shm_pool.tensor.data_ptr() != kv_cache.data_ptr():
            raise ValueError("kv_cache must be shm_pool.tensor when a shared pool is given")
        if not 0 < max_chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
        # this process's receiver: a sender's mapping of the pool is only valid for it
        self.instance_id = secrets.token_hex(8)
        self._pool = ReceiverPool(kv_cache, shm_pool, self.instance_id)
        capable = {t.name for t in transports.all_transports() if t.can_receive(self._pool)}
        allowed = (capable & set(transports.names()) if allowed_kinds is None
                   else set(allowed_kinds))
        if not allowed <= capable:
            raise ValueError(f"this receiver can serve {sorted(capable)}, asked for "
                             f"{sorted(allowed)} (shm needs shm_pool, cuda_ipc a CUDA cache)")
        self.layout, self.kv_cache, self.leases = layout, kv_cache, lease_table
        self.allowed_kinds = frozenset(allowed)
        self.host_id = host or host_id()
        self.device = str(kv_cache.device)
        self.num_blocks = kv_cache.shape[1]
        self.max_chunk_bytes = max_chunk_bytes
        # [num_layers, num_blocks, block bytes]: one row per (layer, block), K and V together
        self._rows = kv_cache.view(torch.uint8).view(layout.num_layers, self.num_blocks, -1)
        self._rows_np = block_rows(kv_cache)
        # A CUDA pool: arrival checks and grpc chunk copies run on a stream of their own,
        # beside the decode steps rather than queued behind them, and each chunk is staged in
        # pinned host memory (one buffer: write_chunk runs on the event loop, one at a time).
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._staging_lock = threading.Lock()
        self._staging = self._staging_ids = None
        if kv_cache.is_cuda and any(not transports.get(k).is_one_sided for k in allowed):
            self._staging = torch.empty(max_chunk_bytes, dtype=torch.uint8, pin_memory=True)
            max_ids = max_chunk_bytes // layout.block_nbytes + 1
            self._staging_ids = torch.empty(max_ids, dtype=torch.long, pin_memory=True)
        self.num_chunks = self.max_chunk_nbytes = 0  # observed PushBlocks chunks
        # lease id -> layer -> the checksum of its destination blocks, queued at layer_done
        self._checks: dict[str, dict[int, Future]] = {}
        # lease id -> its destination block ids on the pool's device (CUDA: uploaded once)
        self._device_ids: dict[str, torch.Tensor] = {}
        self._checks_lock = threading.Lock()
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-verify")
        self._closed = threading.Event()
        self._reap_interval_s = reap_interval_s
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="kv-lease-reaper")
        self._reaper.start()

    def handshake(self, sender_layout: KVLayout, requested: str, sender_host: str,
                  sender_device: str,
                  sender_protocol: int = wire.PROTOCOL_VERSION) -> HandshakeResult:
        mismatches = (wire.protocol_mismatch(sender_protocol, wire.PROTOCOL_VERSION)
                      + sender_layout.mismatch(self.layout))
        if mismatches:
            raise LayoutMismatchError(mismatches)
        kind = select_transport(requested, sender_host, self.host_id, sender_device,
                                self.device, allowed=self.allowed_kinds)
        log.info("kv transfer from host %s (%s) uses %s (requested %s)", sender_host,
                 sender_device, kind, requested)
        return HandshakeResult(kind, transports.get(kind).export(self._pool))

    def begin(self, lease_id: str, dst_block_ids: Sequence[int], kind: str,
              writer: tuple[int, int] = (0, 0), receiver_instance: str = "") -> float:
        """A sender starts on a lease; returns the seconds left before its deadline.
        writer: a one-sided sender's (pid, start ticks), see kv_transfer/process.py.
        receiver_instance: the instance_id the sender handshook with ("": unchecked); another
        one means its connection (and a one-sided sender's mapping) is of a previous process
        at this address, and the lease is refused before anything is written."""
        if receiver_instance and receiver_instance != self.instance_id:
            raise TransportRefusedError(
                f"the sender's connection is to a previous receiver at this address (instance "
                f"{receiver_instance}, now {self.instance_id}): handshake again")
        if kind not in self.allowed_kinds:
            raise TransportRefusedError(f"transport {kind} is not enabled on this receiver")
        lease = self.leases.begin(lease_id, dst_block_ids, kind,
                                  is_one_sided=transports.get(kind).is_one_sided,
                                  writer=writer)
        return lease.deadline - self.leases.now()

    def write_chunk(self, lease_id: str, layer: int, dst_block_ids: Sequence[int],
                    byte_offset: int, data: bytes) -> None:
        """Copy one chunk (whole blocks, or a piece of one block) into the lease's blocks."""
        ids, size, block_nbytes = list(dst_block_ids), len(data), self.layout.block_nbytes
        self._check_layer(layer)
        if size > self.max_chunk_bytes:
            raise ValueError(f"chunk of {size} bytes exceeds max_chunk_bytes "
                             f"{self.max_chunk_bytes}")
        if not ids or max(ids) >= self.num_blocks:
            raise ValueError(f"chunk block ids must be in [0, {self.num_blocks}), got {ids}")
        is_whole = byte_offset == 0 and size == len(ids) * block_nbytes
        is_piece = len(ids) == 1 and size > 0 and byte_offset + size <= block_nbytes
        if not (is_whole or is_piece):
            raise ValueError(f"a chunk of {size} bytes at offset {byte_offset} does not fit "
                             f"{len(ids)} block(s) of {block_nbytes} bytes")
        src = np.frombuffer(data, dtype=np.uint8)
        with self.leases.writing(lease_id, ids, size):
            if self._rows_np is not None:
                if is_whole:
                    self._rows_np[layer, ids] = src.reshape(len(ids), block_nbytes)
                else:
                    self._rows_np[layer, ids[0], byte_offset:byte_offset + size] = src
            else:
                self._write_device(layer, ids, byte_offset, src, is_whole)
        self.num_chunks += 1
        self.max_chunk_nbytes = max(self.max_chunk_nbytes, size)

    def _write_device(self, layer: int, ids: list[int], byte_offset: int, src: np.ndarray,
                      is_whole: bool) -> None:
        """A chunk into a CUDA pool: through the pinned buffer, one non-blocking copy, then the
        stream drained, so the bytes are in place before the lease can end (its blocks may go
        to a decode step on another stream next)."""
        with self._staging_lock, torch.cuda.stream(self._stream):
            data = self._staging[:src.size]
            data.numpy()[:] = src
            t = data.to(self.kv_cache.device, non_blocking=True)
            if is_whole:
                staged_ids = self._staging_ids[:len(ids)]
                staged_ids.numpy()[:] = ids
                index = staged_ids.to(self.kv_cache.device, non_blocking=True)
                self._rows[layer].index_copy_(0, index, t.view(len(ids), -1))
            else:
                self._rows[layer, ids[0], byte_offset:byte_offset + src.size].copy_(t)
            self._stream.synchronize()

    def _checksum(self, kind: str, layer: int, lease_id: str, block_ids: Sequence[int]) -> int:
        """`kind`'s checksum of the destination blocks of `layer` (on the receiver's stream)."""
        with torch.cuda.stream(self._stream):
            if kind == "sum32" and self._stream is not None:  # ids on the device, once a lease
                with self._checks_lock:
                    ids = self._device_ids.get(lease_id)
                if ids is None:
                    ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
                    with self._checks_lock:
                        self._device_ids[lease_id] = ids
                block_ids = ids
            return checksum_blocks_as(kind, self.kv_cache[layer], block_ids)

    def layer_done(self, lease_id: str, layer: int, crc32: int) -> float:
        """A layer is complete in the destination blocks; returns seconds left on the lease."""
        self._check_layer(layer)
        lease = self.leases.record_layer(lease_id, layer, crc32)
        check = self._verifier.submit(self._checksum, _checksum_kind(lease.transport), layer,
                                      lease_id, lease.block_ids)
        with self._checks_lock:
            self._checks.setdefault(lease_id, {})[layer] = check
        return lease.deadline - self.leases.now()

    def num_layers_checked(self, lease_id: str) -> int:
        """Layers of a lease whose arrival check has finished (commit not yet called)."""
        with self._checks_lock:
            return sum(c.done() for c in self._checks.get(lease_id, {}).values())

    def stream_ended(self, lease_id: str) -> bool:
        """A PushBlocks stream ended (half-closed). gRPC reports a dead peer the same way, so
        a stream that ends before every layer is done ends its lease; True if it did."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.num_layers_received == self.layout.num_layers:
            return False
        return self.leases.abort(
            lease_id, f"push stream ended after {lease.num_layers_received} of "
                      f"{self.layout.num_layers} layers: sender gone", writer_stopped=True)

    def commit_is_quick(self, lease_id: str) -> bool:
        """Whether commit() has only a short check left: every reported layer's check has
        finished, and what was never reported (a one-sided sender's last layer) is one device
        kernel (cuda_ipc) or at most QUICK_HOST_CHECK_BYTES hashed on the host (a 2k-token
        layer of the default model is 1.6 MB: ~30 us). The servicer then runs commit on its
        event loop, sparing the thread hop (a few hundred microseconds, more than the work);
        anything longer goes to a thread."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        with self._checks_lock:
            checks = self._checks.get(lease_id, {})
            if not all(check.done() for check in checks.values()):
                return False
            unreported = self.layout.num_layers - len(checks)
        if _checksum_kind(lease.transport) == "sum32":
            return True
        nbytes = unreported * len(lease.block_ids) * self.layout.block_nbytes
        return nbytes == 0 or (not self.kv_cache.is_cuda and nbytes <= QUICK_HOST_CHECK_BYTES)

    def commit(self, lease_id: str, layer_crc32: Sequence[int]) -> CommitResult:
        """Verify every layer's destination blocks against the sender's checksums: the lease
        becomes COMPLETE, or FAILED (released) and VerificationError is raised. A layer never
        reported done (a one-sided sender reports its last layer here) is checked now."""
        lease = self.leases.start_verify(lease_id)
        start = time.perf_counter()
        with self._checks_lock:  # the lease's device ids stay for the last layer's check
            checks = self._checks.pop(lease_id, {})
        num_layers, nbytes = self.layout.num_layers, len(lease.block_ids) * self.layout.block_nbytes
        announced = dict(lease.layer_crc32)
        problems = []
        if len(layer_crc32) != num_layers:
            problems.append(f"commit carries {len(layer_crc32)} checksums for {num_layers} layers")
        if not lease.is_one_sided and lease.num_bytes_received != num_layers * nbytes:
            problems.append(f"received {lease.num_bytes_received} bytes, "
                            f"expected {num_layers * nbytes}")
        kind = _checksum_kind(lease.transport)  # the sender chose the same from the transport
        # the layers never reported done first, while the verifier finishes the others
        unreported = {} if problems else {
            layer: self._checksum(kind, layer, lease_id, lease.block_ids)
            for layer in range(num_layers) if layer not in checks}
        for layer in range(num_layers) if not problems else ():
            check = checks.pop(layer, None)
            actual = check.result() if check is not None else unreported[layer]
            reported = announced.get(layer, layer_crc32[layer])  # commit reports the rest
            if actual != layer_crc32[layer] or reported != layer_crc32[layer]:
                problems.append(f"layer {layer}: destination {kind} {actual:#010x}, layer-done "
                                f"{reported:#010x}, commit {layer_crc32[layer]:#010x}")
        for check in checks.values():  # the layers not looked at (problems found first)
            check.cancel()
        self._drop_checks(lease_id)  # and its device ids
        verify_s = time.perf_counter() - start
        reason = "; ".join(problems[:4]) + (f"; ... {len(problems) - 4} more"
                                            if len(problems) > 4 else "")
        self.leases.complete(lease_id, ok=not problems, reason=f"verification failed: {reason}")
        if problems:
            raise VerificationError(f"lease {lease_id} failed verification: {reason}")
        return CommitResult(num_layers * nbytes, verify_s)

    def abort(self, lease_id: str, reason: str, writer_stopped: bool) -> tuple[bool, str]:
        """(whether this call ended the lease, its state name now or "UNKNOWN")."""
        was_live = self.leases.abort(lease_id, reason, writer_stopped=writer_stopped)
        self._forget_checks(lease_id)
        lease = self.leases.get(lease_id)
        return was_live, lease.state.name if lease else "UNKNOWN"

    def close(self) -> None:
        """Stop the reaper and the verifier (leases stay in the table)."""
        self._closed.set()
        self._reaper.join()
        self._verifier.shutdown(wait=True, cancel_futures=True)

    def _drop_checks(self, lease_id: str) -> dict[int, Future]:
        with self._checks_lock:
            self._device_ids.pop(lease_id, None)
            return self._checks.pop(lease_id, {})

    def _forget_checks(self, lease_id: str) -> None:
        for check in self._drop_checks(lease_id).values():
            check.cancel()

    def _drop_ended_checks(self) -> None:
        """Forget the queued checks and uploaded block ids of leases that ended without a
        commit (expired, or aborted where abort() was not called: a lost stream, the reaper)."""
        with self._checks_lock:
            ids = set(self._checks) | set(self._device_ids)
        for lease_id in ids:
            lease = self.leases.get(lease_id)
            if lease is None or lease.state.is_terminal:
                self._forget_checks(lease_id)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer}")

    def _reap(self) -> None:
        while not self._closed.wait(self._reap_interval_s):
            try:
                self.leases.expire_due()
                self._drop_ended_checks()
            except Exception:
                log.exception("lease reaper failed")


def _checksum_kind(transport: str) -> str:
    """The checksum a transfer over `transport` carries (its sender computes the same)."""
    return transports.get(transport).checksum_kind
