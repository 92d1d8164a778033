"""The prefill worker: a PrefillEngine (prefill_service/engine.py) behind the engine thread of
the colocated backend, whose requests stop after their first token and push their prompt KV to
a decode worker's reservation; and its connections to the decode workers. Its gRPC service
(prefill_service/service.py) only translates.

    prefill(request, target):
      connect to the decode worker (handshake once per address, cached)
      -> register the handoff target -> run the request (max_tokens=1) in the engine thread
      -> every layer's KV leaves during the last prefill step (prefill_service/engine.py)
      -> the engine thread requests the commit after the last layer; the decode worker
         verifies checksums, and the loop awaits the verdict
      -> on_prefilled(prompt): publishes the prompt's cached blocks (gateways route by them)
      -> the first token, its timings and the transfer's stats
    Cancellation (client gone, deadline) aborts the engine request and the transfer session,
    which tells the decode worker to end the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine_core.sampling_params import SamplingParams
from kv_transfer import (
    Connection,
    KVTransferError,
    LayoutMismatchError,
    SendSession,
    TransferError,
    TransferStats,
    TransportRefusedError,
    connect,
)
from prefill_service.engine import HandoffTarget, PrefillEngine
from service_infra import tracing
from service_infra.backend import GenerateChunk, GenerateInput
from service_infra.colocated import ColocatedBackend
from service_infra.metrics.worker import KVTransferMetrics
from service_infra.prefix_record import PrefixRecord
from service_infra.tls import TLSConfig

logger = logging.getLogger(__name__)
COMMIT_TIMEOUT_S = 30.0
# TransferError codes of a transfer whose lease ended (aborted by the gateway or the decode
# worker, expired, unknown to the receiver) or that this worker gave up on: the connection is
# fine (one to a previous receiver is refused FAILED_PRECONDITION at Begin) and other
# requests' transfers are using it, so it is kept.
LEASE_ENDED_CODES = frozenset({"ABORTED", "CANCELLED", "NOT_FOUND"})
TRANSFER_SPEED_EWMA_WEIGHT = 0.2  # of the newest transfer in kv_transfer_bytes_per_s


@dataclass(frozen=True)
class KVDestination:
    """Where a request's prompt KV goes: the decode worker's reservation."""

    transfer_address: str  # the decode worker's KV receiver
    transport: str  # requested kind ("auto": negotiated)
    transfer_instance: str  # the receiver instance the reservation was made on ("": any)
    lease_id: str
    dst_block_ids: list[int]  # the blocks to write, from first_block on
    first_block: int  # prompt blocks before it are cached there: not sent


@dataclass(frozen=True)
class Prefilled:
    """A prefill whose KV the decode worker has verified."""

    first: GenerateChunk  # the engine's last chunk: the first token, its logprobs, timing
    prompt_logprobs: list | None  # when the request asked for them
    stats: TransferStats
    transport: str  # the kind the connection uses
    t_first: float  # time.monotonic() when the first token was sampled


class PrefillAborted(RuntimeError):
    """The engine aborted the request before its first token."""


class TargetRefused(RuntimeError):
    """The decode worker's handshake refused this worker (another KV layout; a transport it
    does not serve)."""


def _trace_phases(t_received: float, timing, stats) -> None:
    """queue and prefill as the engine timed them; kv_transfer from the transfer's begin
    (before the forward: the layer-wise push overlaps it) to the verified commit."""
    now = time.monotonic()
    scheduled = t_received + (timing.queue_s if timing else 0.0)
    tracing.phase("queue", t_received, scheduled)
    tracing.phase("prefill", scheduled, scheduled + (timing.prefill_s if timing else 0.0))
    tracing.phase("kv_transfer", now - stats.seconds, now, **{
        "pdserve.kv_transport": stats.transport, "pdserve.kv_bytes": stats.num_bytes})


class PrefillWorker:
    """Create inside the running event loop (like ColocatedBackend)."""

    def __init__(self, engine: PrefillEngine, backend: ColocatedBackend,
                 metrics: KVTransferMetrics,
                 on_prefilled: Callable[[list[int]], None] | None = None,
                 tls: TLSConfig | None = None, prefix: PrefixRecord | None = None,
                 offloaded: PrefixRecord | None = None) -> None:
        """prefix, offloaded: the blocks Status lists as held in the pool and in the offload
        tiers (None: published elsewhere, or none)."""
        self.engine = engine
        self.backend = backend
        self.on_prefilled = on_prefilled  # on the request path: must not block or raise
        self.prefix = prefix
        self.offloaded = offloaded
        # its offload tiers that other workers reach too (Status): read once, here
        self.offload_tier_ids = (engine.offloader.shared_tier_ids()
                                 if engine.offloader is not None else [])
        self.metrics = metrics
        metrics.count_active_by(self.transfers_active)
        self.tls = tls  # mutual TLS to the decode workers' KV transfer service
        self._connections: dict[tuple[str, str], Connection] = {}
        self._connecting: dict[tuple[str, str], asyncio.Lock] = {}
        # the link's speed as recent transfers saw it, a moving average (0: none yet): bytes
        # from the first layer queued to the commit verified (TransferStats.link_seconds); a
        # transfer that kept up with the forward reads as the forward's pace, which the cost
        # model's overlap then cancels
        self.kv_transfer_bytes_per_s = 0.0

    async def prefill(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      num_prior_output_tokens: int, dest: KVDestination, arrival: float,
                      deadline: float | None) -> Prefilled:
        """Prefill the prompt and push its KV to `dest`; its first token once the decode
        worker verified the KV. Raises TargetRefused, KVTransferError (the transfer or the
        decode side failed), PrefillAborted, or the Backend's errors (Overloaded: the queue
        is full; DeadlineExceeded; BackendUnavailable; ValueError)."""
        # the first token only: stop strings and the token budget are the decode worker's
        first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())
        try:
            conn = await self._connection(dest.transfer_address, dest.transport,
                                          dest.transfer_instance)
        except (LayoutMismatchError, TransportRefusedError) as e:
            raise TargetRefused(str(e)) from e
        except KVTransferError:  # the decode side: the gateway keeps this worker healthy
            self.metrics.failed(dest.transport, "connect")
            raise

        loop = asyncio.get_running_loop()
        sent: asyncio.Future = loop.create_future()

        def on_sent(session: SendSession | None, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, sent, session, error)

        handoff = HandoffTarget(conn, dest.lease_id, list(dest.dst_block_ids), dest.first_block,
                                on_sent)
        self.engine.set_target(req_id, handoff)
        inp = GenerateInput(req_id, list(prompt_token_ids), first, arrival=arrival,
                            deadline=deadline, num_prior_output_tokens=num_prior_output_tokens)
        is_done = False
        try:
            last, prompt_lps = None, None
            async with contextlib.aclosing(self.backend.generate(inp)) as chunks:
                async for chunk in chunks:
                    last = chunk
                    prompt_lps = chunk.prompt_logprobs or prompt_lps
            if last is None or last.finish_reason == "abort" or not last.token_ids:
                raise PrefillAborted(f"request {req_id} was aborted")
            t_first = time.monotonic()
            session = await sent
            stats = await _committed(session, COMMIT_TIMEOUT_S)
            is_done = True
            if self.on_prefilled is not None:
                self.on_prefilled(list(prompt_token_ids))
            self.metrics.transferred(stats.transport, stats.seconds, stats.num_bytes)
            self._measure_transfer(stats.num_bytes, stats.link_seconds)
            if tracing.is_on():  # children of this call's span (service_infra/tracing.py)
                _trace_phases(arrival, last.timing, stats)
        except KVTransferError as e:
            self.metrics.failed(conn.kind, getattr(e, "code", "") or type(e).__name__)
            if getattr(e, "code", "") not in LEASE_ENDED_CODES:
                self._forget(conn)
            raise
        finally:
            self.engine.pop_target(req_id)
            if not is_done and handoff.session is not None:
                handoff.session.abort("prefill cancelled or failed")
        return Prefilled(last, prompt_lps, stats, conn.kind, t_first)

    def _measure_transfer(self, num_bytes: int, seconds: float) -> None:
        """The moving average is of seconds per byte, not of bytes per second: what the cost
        model predicts is a transfer's time, and a link that slowed down shows in it after a
        transfer or two (an average of speeds would hold the fast ones for tens)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        per_byte, w = seconds / num_bytes, TRANSFER_SPEED_EWMA_WEIGHT
        if self.kv_transfer_bytes_per_s > 0.0:
            per_byte = (1 - w) / self.kv_transfer_bytes_per_s + w * per_byte
        self.kv_transfer_bytes_per_s = 1.0 / per_byte

    async def _connection(self, address: str, kind: str, instance: str = "") -> Connection:
        """The cached connection to the decode worker at `address`, or a new handshake when
        there is none or it is to another receiver `instance` than the reservation's. Then
        either the worker restarted at the same address (the cached connection maps its old
        pool: replaced), or the reservation was made on the previous process (TransferError;
        the cached connection, which other requests' transfers use, is kept)."""
        key = (address, kind)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:  # one handshake per decode worker, however many requests wait on it
            conn = self._connections.get(key)
            if conn is None or (instance and conn.receiver_instance != instance):
                fresh = await asyncio.to_thread(
                    connect, kind, address, self.engine.layout, device=str(self.engine.device),
                    credentials=self.tls.channel_credentials() if self.tls else None,
                    channel_options=self.tls.channel_options() if self.tls else ())
                self.metrics.connected(address, fresh.kind, fresh.control, fresh.fallback_from)
                if conn is None or conn.receiver_instance != fresh.receiver_instance:
                    if conn is not None:
                        logger.info("decode worker %s restarted (receiver instance %s, was "
                                    "%s): handshook again", address, fresh.receiver_instance,
                                    conn.receiver_instance)
                        self._forget(conn)
                    conn = self._connections[key] = fresh
                else:
                    self._close_later(fresh)
            if instance and conn.receiver_instance != instance:
                raise TransferError(f"the reservation was made on a previous decode worker at "
                                    f"{address} (instance {instance}, now "
                                    f"{conn.receiver_instance})")
            return conn

    def transfers_active(self) -> dict[str, int]:
        """Transfers begun and not yet ended, by transport (any thread: the metrics')."""
        active: dict[str, int] = {}
        for conn in list(self._connections.values()):
            active[conn.kind] = active.get(conn.kind, 0) + conn.num_active
        return active

    def _forget(self, conn: Connection) -> None:
        """A failed transfer may mean the decode worker restarted: handshake again next time.
        Closing aborts every transfer still running on the connection."""
        for key, c in list(self._connections.items()):
            if c is conn:
                del self._connections[key]
                self._close_later(c)

    @staticmethod
    def _close_later(conn: Connection) -> None:
        """Close off the event loop: aborting its transfers waits for their threads."""
        asyncio.get_running_loop().run_in_executor(None, _close_quietly, conn)

    def close(self) -> None:
        for conn in self._connections.values():
            _close_quietly(conn)
        self._connections.clear()


async def _committed(session: SendSession, timeout_s: float) -> TransferStats:
    """The stats of a session whose commit the engine thread has requested (HandoffStep), once
    the receiver has verified it; TransferError if it failed. The loop hears of the end from
    the session thread: no worker thread waits on commit(), and no hop to one starts it."""
    loop = asyncio.get_running_loop()
    ended = loop.create_future()

    def wake() -> None:
        if not ended.done():
            ended.set_result(None)

    session.add_done_callback(lambda: loop.call_soon_threadsafe(wake))
    try:
        await asyncio.wait_for(ended, timeout_s)
    except TimeoutError:  # abort() waits for the session thread: off the loop
        await asyncio.to_thread(session.abort, f"commit timed out after {timeout_s:.3f}s")
    return session.commit(0)  # ended: the stats, or its error, at once


def _close_quietly(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        conn.close()


def _settle(fut: asyncio.Future, session: SendSession | None, error: BaseException | None):
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(session)
