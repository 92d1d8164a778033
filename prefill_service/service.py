"""The prefill worker's gRPC service: protobuf in, engine types inside, status codes out.

Prefill(request):
    connect to the decode worker (handshake once per address, cached)
    -> register the handoff target -> run the request (max_tokens=1) in the engine thread
    -> every layer's KV leaves during the last prefill step (prefill_service/engine.py)
    -> the engine thread requests the commit after the last layer; the decode worker verifies
       checksums, and the loop awaits the verdict
    -> on_prefilled(prompt): publishes the prompt's cached blocks (gateways route by them)
    -> reply with the first token and the timings
Cancellation (client gone, deadline) aborts the engine request and the transfer session, which
tells the decode worker to end the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import grpc

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
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra import tracing
from service_infra.backend import BackendUnavailable, DeadlineExceeded, GenerateInput, Overloaded
from service_infra.colocated import ColocatedBackend
from service_infra.metrics.worker import KVTransferMetrics
from service_infra.prefix_record import PrefixRecord
from service_infra.proto_convert import (
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)
from service_infra.tls import TLSConfig

logger = logging.getLogger(__name__)
COMMIT_TIMEOUT_S = 30.0
# TransferError codes of a transfer whose lease ended (aborted by the gateway or the decode
# worker, expired, unknown to the receiver) or that this worker gave up on: the connection is
# fine (one to a previous receiver is refused FAILED_PRECONDITION at Begin) and other
# requests' transfers are using it, so it is kept.
LEASE_ENDED_CODES = frozenset({"ABORTED", "CANCELLED", "NOT_FOUND"})
TRANSFER_SPEED_EWMA_WEIGHT = 0.2  # of the newest transfer in kv_transfer_bytes_per_s


def _trace_phases(t_received: float, timing, stats) -> None:
    """queue and prefill as the engine timed them; kv_transfer from the transfer's begin
    (before the forward: the layer-wise push overlaps it) to the verified commit."""
    now = time.monotonic()
    scheduled = t_received + (timing.queue_s if timing else 0.0)
    tracing.phase("queue", t_received, scheduled)
    tracing.phase("prefill", scheduled, scheduled + (timing.prefill_s if timing else 0.0))
    tracing.phase("kv_transfer", now - stats.seconds, now, **{
        "pdserve.kv_transport": stats.transport, "pdserve.kv_bytes": stats.num_bytes})


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, engine: PrefillEngine, backend: ColocatedBackend,
                 metrics: KVTransferMetrics,
                 on_prefilled: Callable[[list[int]], None] | None = None,
                 tls: TLSConfig | None = None, prefix: PrefixRecord | None = None) -> None:
        """prefix: the prefix blocks Status lists (None: published elsewhere, or none)."""
        self.engine = engine
        self.backend = backend
        self.on_prefilled = on_prefilled  # on the request path: must not block or raise
        self.prefix = prefix
        self.metrics = metrics
        self.tls = tls  # mutual TLS to the decode workers' KV transfer service
        self._connections: dict[tuple[str, str], Connection] = {}
        self._connecting: dict[tuple[str, str], asyncio.Lock] = {}
        # the link's speed as recent transfers saw it, a moving average (0: none yet): bytes
        # from the first layer queued to the commit verified (TransferStats.link_seconds); a
        # transfer that kept up with the forward reads as the forward's pace, which the cost
        # model's overlap then cancels
        self.kv_transfer_bytes_per_s = 0.0

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        t_received = time.monotonic()
        req_id, target = request.request_id, request.target
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        n_prompt = len(request.prompt_token_ids)
        num_blocks = -(-n_prompt // self.engine.layout.block_size)
        if not req_id or n_prompt == 0 or len(target.dst_block_ids) != (
                num_blocks - target.first_block):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id and prompt_token_ids must be set and "
                                f"target.dst_block_ids must have {num_blocks} - first_block "
                                f"({target.first_block}) entries, got "
                                f"{len(target.dst_block_ids)}")
        if request.num_prior_output_tokens >= n_prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_prior_output_tokens must be < the prompt's "
                                f"{n_prompt} tokens, got {request.num_prior_output_tokens}")
        # the first token only: stop strings and the token budget are the decode worker's
        first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=())
        try:
            conn = await self._connection(target.transfer_address, target.transport or "auto",
                                          target.transfer_instance)
        except (LayoutMismatchError, TransportRefusedError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KVTransferError as e:  # the decode side: the gateway keeps this worker healthy
            self.metrics.failed(target.transport or "auto", "connect")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed: {e}")

        loop = asyncio.get_running_loop()
        sent: asyncio.Future = loop.create_future()

        def on_sent(session: SendSession | None, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, sent, session, error)

        handoff = HandoffTarget(conn, target.lease_id, list(target.dst_block_ids),
                                target.first_block, on_sent)
        self.engine.set_target(req_id, handoff)
        remaining = context.time_remaining()
        inp = GenerateInput(req_id, list(request.prompt_token_ids), first, arrival=t_received,
                            deadline=None if remaining is None else t_received + remaining,
                            num_prior_output_tokens=request.num_prior_output_tokens)
        is_done = False
        try:
            last, prompt_lps = None, None
            async with contextlib.aclosing(self.backend.generate(inp)) as chunks:
                async for chunk in chunks:
                    last = chunk
                    prompt_lps = chunk.prompt_logprobs or prompt_lps
            if last is None or last.finish_reason == "abort" or not last.token_ids:
                await context.abort(grpc.StatusCode.ABORTED, f"request {req_id} was aborted")
            t_first = time.monotonic()
            session = await sent
            stats = await _committed(session, COMMIT_TIMEOUT_S)
            is_done = True
            if self.on_prefilled is not None:
                self.on_prefilled(list(request.prompt_token_ids))
            self.metrics.transferred(stats.transport, stats.seconds, stats.num_bytes)
            self._measure_transfer(stats.num_bytes, stats.link_seconds)
            if tracing.is_on():  # children of this call's span (service_infra/tracing.py)
                _trace_phases(t_received, last.timing, stats)
        except KVTransferError as e:
            self.metrics.failed(conn.kind, getattr(e, "code", "") or type(e).__name__)
            if getattr(e, "code", "") not in LEASE_ENDED_CODES:
                self._forget(conn)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed: {e}")
        except Overloaded as e:  # the queue is full: the gateway tries another prefill worker
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except DeadlineExceeded as e:  # the call's deadline, propagated by the gateway
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except BackendUnavailable as e:  # the engine failed or is shutting down
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            self.engine.pop_target(req_id)
            if not is_done and handoff.session is not None:
                handoff.session.abort("prefill cancelled or failed")
        timing = last.timing
        reply = pb.PrefillResponse(
            first_token_id=last.token_ids[0], queue_s=timing.queue_s if timing else 0.0,
            compute_s=timing.prefill_s if timing else 0.0,
            transfer_tail_s=time.monotonic() - t_first, transfer_bytes=stats.num_bytes,
            transport=conn.kind, num_cached_tokens=last.num_cached_tokens)
        if last.logprobs:
            reply.first_logprob.CopyFrom(logprob_to_proto(last.token_ids[0], last.logprobs[0]))
        if prompt_lps is not None:
            reply.prompt_logprobs.extend(
                prompt_logprobs_to_proto(list(request.prompt_token_ids), prompt_lps))
        return reply

    async def Status(self, request: pb.StatusRequest, context) -> pb.WorkerStatus:
        s = self.backend.status_now()
        return pb.WorkerStatus(
            role="prefill", model=self.engine.source.name,
            layout_fingerprint=self.engine.layout.fingerprint(), num_blocks=s["num_blocks"],
            num_free_blocks=s["num_free_blocks"], num_running=s["num_running"],
            num_waiting=s["num_waiting"], block_size=self.engine.layout.block_size,
            prefill_tokens_per_s=self.engine.stats.prefill_tokens_per_s,
            decode_step_s=self.engine.stats.decode_step_s,
            kv_transfer_bytes_per_s=self.kv_transfer_bytes_per_s,
            kv_bytes_per_token=self.engine.layout.bytes_per_token,
            prefix_block_hashes=self.prefix.hashes() if self.prefix is not None else ())

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
