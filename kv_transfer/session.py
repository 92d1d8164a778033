"""One request's KV transfer, sender side: a bounded pipeline from the model thread to the wire.

    model thread                          session thread (one per session)
    ------------                          --------------------------------
    Connection.begin() ─ starts ───────-> Begin RPC: lease alive, blocks are the lease's
    send_layer(0): snapshot ──┐
    send_layer(1): snapshot ──┤ queue     ship the layer: grpc chunks + LayerDone (in-stream),
    ...                       │ bounded   or a direct write + LayerDone (shm, cuda_ipc)
    request_commit() ─────────┘────────-> Commit: the receiver verifies the checksums
    commit(): wait for the verdict        (add_done_callback: hear of it without waiting)
    abort(reason), any thread:            stop the thread, then Abort RPC

send_layer copies the layer's source blocks (so the caller may reuse them at once) and
enqueues the copy; it blocks only while `max_queued_layers` copies wait, which bounds memory.
States: SENDING -> COMMITTING -> COMMITTED | FAILED, and SENDING | COMMITTING -> ABORTED.
A session that has failed or been aborted makes send_layer return False instead of raising, so
one request's failure never breaks the model loop; commit() raises TransferError.

One-sided writes (shm, cuda_ipc) stop WRITE_MARGIN_S before the lease deadline as the sender
sees it (send time of the last reply + the receiver's remaining time: a lower bound), because
the receiver may free expired blocks at the deadline without hearing from us.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer.blocks import gather_blocks
from kv_transfer.errors import TransferError
from kv_transfer.process import my_identity
from kv_transfer.send_options import SenderOptions, SendState, TransferStats
from protos.pdserve.internal import kv_transfer_pb2 as pb

log = logging.getLogger("pdserve.kv_transfer")

WRITE_MARGIN_S = 0.25  # one-sided writers stop this long before the lease deadline
_POLL_S = 0.05  # how often a blocked send_layer re-checks that the session is alive


@dataclass(frozen=True)
class _Layer:
    layer: int
    blocks: torch.Tensor  # [n, 2, block_size, num_kv_heads, head_dim], contiguous snapshot
    ready: torch.cuda.Event | None  # recorded after the snapshot on the model's stream


_COMMIT, _WAKE = object(), object()


class _Stopped(Exception):
    """The session was aborted; unwinds the session thread quietly."""


class SendSession:
    """Base of the transports' sessions; subclasses implement `_pump` (and `_interrupt`).
    kind, wire_kind: the transport's name and TransportKind (transports/base.py)."""

    # The receiver writes our bytes itself (grpc), under its lease lock: an Abort can never
    # race a write. One-sided senders write into the pool and must stop before aborting.
    is_two_sided = False

    def __init__(self, stub, layout: KVLayout, lease_id: str, src_block_ids: Sequence[int],
                 dst_block_ids: Sequence[int], options: SenderOptions,
                 receiver_instance: str = "", *, kind: str, wire_kind: int) -> None:
        self.kind, self._wire_kind = kind, wire_kind
        self.lease_id = lease_id
        self._receiver_instance = receiver_instance  # checked by the receiver at Begin
        self._stub, self._layout, self._options = stub, layout, options
        self._src_ids = [int(b) for b in src_block_ids]
        self._src_index: torch.Tensor | None = None  # _src_ids on a CUDA cache's device
        self._dst_ids = [int(b) for b in dst_block_ids]
        self._queue: queue.Queue = queue.Queue(maxsize=options.max_queued_layers)
        # host snapshots already shipped, for send_layer to gather the next layers into: a
        # fresh 1.6 MB buffer a layer costs page faults, and its release ~0.3 ms of unmapping
        # on the session thread, which the last layer's would add to the handoff
        self._spare: collections.deque[torch.Tensor] = collections.deque()
        self._num_buffers = 0  # host snapshot buffers allocated
        self._lock = threading.Lock()
        self._state = SendState.SENDING
        self._error: TransferError | None = None
        self._stop_reason = ""  # a local reason to fail, set where raising is not possible
        self._done = threading.Event()
        self._callbacks: list[Callable[[], None]] = []  # add_done_callback's
        self._t0 = time.perf_counter()
        self._lease_deadline = time.monotonic() + options.rpc_timeout_s  # until Begin replies
        # what each delivered layer gives the lease again (its ttl, as Begin's reply said)
        self._lease_ttl_s = options.rpc_timeout_s
        self._queued_s: dict[int, float] = {}
        self._shipped_s: dict[int, float] = {}
        self._crc32: dict[int, int] = {}
        self._num_bytes = self._num_chunks = 0
        self._commit_t = self._commit_s = self._verify_s = self._commit_rpc_s = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-send-{lease_id[:8]}")

    # -- model-thread API ------------------------------------------------------------------
    @property
    def state(self) -> SendState:
        return self._state

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def num_queued_layers(self) -> int:
        return self._queue.qsize()

    def send_layer(self, layer: int, kv_cache: torch.Tensor) -> bool:
        """Snapshot kv_cache[layer][src_block_ids] and queue it; False if the session has
        ended (see `error`). kv_cache: [num_layers, num_blocks, 2, block_size, heads, dim]."""
        if not 0 <= layer < self._layout.num_layers:
            raise ValueError(f"layer must be in [0, {self._layout.num_layers}), got {layer}")
        if (kv_cache.dim() != 6 or kv_cache.dtype != self._layout.torch_dtype
                or tuple(kv_cache.shape) != self._layout.cache_shape(kv_cache.shape[1])):
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not "
                             f"match the layout {self._layout}")
        with self._lock:
            if self._state is not SendState.SENDING:
                return False
            if layer in self._queued_s:
                raise ValueError(f"layer {layer} sent twice")
            self._queued_s[layer] = -1.0
        ids: Sequence[int] | torch.Tensor = self._src_ids
        if kv_cache.is_cuda:  # uploaded once, not a pageable copy (and a sync) per layer
            if self._src_index is None:
                self._src_index = torch.as_tensor(ids, dtype=torch.long, device=kv_cache.device)
            ids = self._src_index
        spare = None
        if not kv_cache.is_cuda:
            try:
                spare = self._spare.pop()
            except IndexError:  # none shipped yet, or all still queued: a new buffer
                self._num_buffers += 1
        blocks = gather_blocks(kv_cache, layer, ids, out=spare)  # [n, 2, bs, heads, dim]
        ready = None
        if blocks.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(blocks.device))
        queued = self._put(_Layer(layer, blocks, ready))
        self._queued_s[layer] = self._elapsed()
        return queued

    def request_commit(self) -> bool:
        """Ask for the commit once every layer is shipped, without waiting for it: the session
        thread sends it right after the last layer. Blocks only while max_queued_layers
        snapshots wait (as send_layer does). True if the commit is on its way (now or before);
        False if the session has ended, or a layer was never sent (it is aborted then)."""
        with self._lock:
            if self._state is not SendState.SENDING:
                return self._state is SendState.COMMITTING
            missing = sorted(set(range(self._layout.num_layers)) - set(self._queued_s))
            if not missing:
                self._state = SendState.COMMITTING
                self._commit_t = time.perf_counter()
        if missing:
            self.abort(f"commit with layers {missing} never sent")
            return False
        return self._put(_COMMIT)

    def commit(self, timeout: float | None = None) -> TransferStats:
        """Wait for every layer to be shipped and verified by the receiver (requesting the
        commit if nobody has); the stats, or TransferError (the lease is then released on the
        receiver)."""
        if self.request_commit():
            timeout = self._options.commit_timeout_s if timeout is None else timeout
            if not self._done.wait(timeout):
                self.abort(f"commit timed out after {timeout:.3f}s")
        else:  # ended: let the thread finish telling the receiver before we report it
            self._done.wait(self._options.rpc_timeout_s)
        with self._lock:
            if self._state is SendState.COMMITTED:
                return self._stats()
            assert self._error is not None
            raise self._error

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call fn() when the session thread ends (committed, failed or aborted; commit() then
        returns at once): from that thread, or now if it has ended. For an event loop that
        waits without parking a thread on commit()."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def abort(self, reason: str) -> bool:
        """Stop sending and release the lease on the receiver; False if already ended."""
        with self._lock:
            if self._state not in (SendState.SENDING, SendState.COMMITTING):
                return False
            self._state = SendState.ABORTED
            self._error = TransferError(f"{self.kind} transfer of lease {self.lease_id} "
                                        f"aborted by the sender: {reason}", "CANCELLED")
        if self.is_two_sided:  # tell the receiver first, so our reason is the one it keeps
            self._send_abort(reason, writer_stopped=True)
        self._interrupt()
        with contextlib.suppress(queue.Full):  # full: the thread is not waiting for a layer
            self._queue.put_nowait(_WAKE)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self._options.rpc_timeout_s)
        if not self.is_two_sided:  # one-sided: only a stopped writer may free the blocks
            self._send_abort(reason, writer_stopped=not self._thread.is_alive())
        return True

    def join(self, timeout: float | None = None) -> None:
        """Wait for the session thread to end (after commit or abort it only cleans up): the
        owner of the channel it used closes it after this."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- session thread --------------------------------------------------------------------
    def start(self) -> SendSession:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            sent = time.monotonic()
            pid, ticks = (0, 0) if self.is_two_sided else my_identity()
            reply = self._begin_rpc(pb.BeginRequest(
                lease_id=self.lease_id, dst_block_ids=self._dst_ids,
                transport=self._wire_kind, sender_pid=pid,
                sender_start_ticks=ticks, receiver_instance=self._receiver_instance))
            self._lease_deadline = sent + reply.remaining_ms / 1000
            self._lease_ttl_s = reply.remaining_ms / 1000
            self._pump()
            if self._stop_reason:
                raise TransferError(self._stop_reason)
            self._check_alive()
            layer_crc32 = [self._crc32[layer] for layer in range(self._layout.num_layers)]
            rpc_t = time.perf_counter()
            reply = self._commit_rpc(pb.CommitRequest(lease_id=self.lease_id,
                                                      layer_crc32=layer_crc32))
            self._verify_s = reply.verify_us / 1e6
            self._commit_rpc_s = time.perf_counter() - rpc_t
            with self._lock:
                if self._state is SendState.COMMITTING:
                    self._state = SendState.COMMITTED
                    self._commit_s = time.perf_counter() - self._commit_t
        except _Stopped:
            pass
        except grpc.RpcError as e:
            self._fail(f"{e.code().name}: {e.details()}", e.code().name)
        except TransferError as e:
            self._fail(str(e), e.code)
        except Exception as e:  # a bug or a torch error: fail this request, not the process
            if self._state is not SendState.ABORTED:
                log.exception("KV send session %s crashed", self.lease_id)
            self._fail(repr(e), "INTERNAL")
        finally:
            self._finish()
            self._done.set()
            with self._lock:  # (after set: a callback added from now on runs at once)
                callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                try:
                    fn()
                except Exception:
                    log.exception("a done callback of KV send session %s failed", self.lease_id)
            while not self._queue.empty():  # drop snapshots now, not when the session dies
                self._queue.get_nowait()
            self._spare.clear()  # after done: their release is off the commit's path

    def _next_layer(self) -> _Layer | None:
        """The next queued layer; None at commit. Raises _Stopped once aborted, and stops
        with `_stop_reason` if no layer comes well past the lease deadline (the model thread
        stalled; the receiver has expired the lease by then, this only ends our thread)."""
        while True:
            wait_s = self._lease_deadline + self._options.rpc_timeout_s - time.monotonic()
            try:
                item = self._queue.get(timeout=max(wait_s, 0.0))
            except queue.Empty:
                self._stop_reason = "no layer to send until past the lease deadline"
                return None
            self._check_alive()
            if item is _COMMIT:
                return None
            if item is not _WAKE:
                if item.ready is not None:
                    item.ready.synchronize()
                return item

    def _shipped(self, item: _Layer, crc32: int) -> None:
        """Every byte of `item` has reached the receiver (or the transport's own buffers); its
        snapshot is free for send_layer to reuse."""
        layer, nbytes = item.layer, item.blocks.nbytes
        if self.is_two_sided:  # the receiver gives the lease its ttl again as a layer lands
            self._lease_deadline = max(self._lease_deadline,
                                       time.monotonic() + self._lease_ttl_s)
        if not item.blocks.is_cuda and not self._done.is_set():
            self._spare.append(item.blocks)
        self._crc32[layer] = crc32
        self._num_bytes += nbytes
        self._shipped_s[layer] = self._elapsed()

    def _check_alive(self) -> None:
        if self._state is SendState.ABORTED:
            raise _Stopped

    def _fail(self, message: str, code: str) -> None:
        with self._lock:
            if self._state not in (SendState.SENDING, SendState.COMMITTING):
                return
            self._state = SendState.FAILED
            self._error = TransferError(f"{self.kind} transfer of lease {self.lease_id} "
                                        f"failed: {message}", code)
        # This thread writes no more: tell the receiver it may release the blocks now.
        self._send_abort(f"sender failed: {message}", writer_stopped=True)

    def _send_abort(self, reason: str, writer_stopped: bool) -> None:
        try:
            self._stub.Abort(pb.AbortRequest(lease_id=self.lease_id, reason=reason,
                                             writer_stopped=writer_stopped),
                             timeout=self._options.rpc_timeout_s)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the channel is closed
            code = e.code().name if isinstance(e, grpc.RpcError) else str(e)
            log.warning("abort of lease %s not delivered (%s); it expires on the receiver",
                        self.lease_id, code)

    def _put(self, item: object) -> bool:
        while not self._done.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def _stats(self) -> TransferStats:
        num_layers = self._layout.num_layers
        return TransferStats(
            transport=self.kind, num_layers=num_layers, num_blocks=len(self._dst_ids),
            num_bytes=self._num_bytes, num_chunks=self._num_chunks,
            seconds=self._commit_t + self._commit_s - self._t0,
            commit_seconds=self._commit_s, verify_seconds=self._verify_s,
            commit_rpc_seconds=self._commit_rpc_s,
            layer_queued_s=tuple(self._queued_s[i] for i in range(num_layers)),
            layer_shipped_s=tuple(self._shipped_s[i] for i in range(num_layers)),
            num_snapshot_buffers=self._num_buffers)

    # -- transport hooks -------------------------------------------------------------------
    def _pump(self) -> None:
        """Ship layers from `_next_layer()` until it returns None."""
        raise NotImplementedError

    def _begin_rpc(self, request: pb.BeginRequest) -> pb.BeginResponse:
        """Announce the sender and learn the lease's time left (RpcError / TransferError)."""
        return self._stub.Begin(request, timeout=self._options.rpc_timeout_s)

    def _commit_rpc(self, request: pb.CommitRequest) -> pb.CommitResponse:
        """Send the Commit and wait for the receiver's verdict (RpcError / TransferError)."""
        return self._stub.Commit(request, timeout=self._options.commit_timeout_s)

    def _finish(self) -> None:
        """The session thread ends (any outcome): release what the transport held."""

    def _interrupt(self) -> None:
        """Unblock the data plane after abort (e.g. cancel a stream); default: nothing."""
