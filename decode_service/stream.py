"""A gateway's output stream on this decode worker (Decode.Stream): every request the gateway
starts here streams through it, one message per engine step for all of them.

    gateway -> StreamRequest{reserve}                           reserve, as the Reserve call
                                                                does; the answer goes out at
                                                                once, in `reserved`
               StreamRequest{decode | prefill_locally | fork}   start: claim the lease (or
                                                                withdraw it, or fork) and
                                                                open the request in the engine
               StreamRequest{abort}                             end one early
    engine thread, each step -> the loop: each request's delta goes to its sink here, which
                                merges it into `pending` (one entry per request)
    writer -> StepOutputs of everything pending, then waits for the next step's news

A request's life here: starting (its lease wait, as a task) -> open (in the engine, deltas to
its sink) -> ended (its last entry, finish reason or error, is pending or sent). While a write
waits for the gateway (flow control), later steps merge into `pending`: the engine never
waits for a stream, and a slow gateway gets fewer, larger messages. The stream's end (the
gateway went away, or the worker stops) aborts every request still open on it, and ends the
reservations made on it that no start message claimed, so their blocks are freed. A start
message with a trace context (the gateway traces the request) opens the request's SERVER span
here, named for the RPC it stands for (a reserve message's ends with its answer); its last
entry ends it, with its phases here as children: `claim` (start message -> in the engine: for
a decode, the wait for its KV's commit), `first_decode_step` (first token -> second) and
`stream` (first token -> last entry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from decode_service.worker import DecodeWorker, LeaseNotReady, fork_input
from engine_core.outputs import RequestDelta
from protos.pdserve.internal import workers_pb2 as pb
from service_infra import tracing
from service_infra.backend import BackendUnavailable, GenerateInput
from service_infra.colocated import StartRequest
from service_infra.proto_convert import (
    FINISH_REASONS,
    logprob_from_proto,
    logprob_to_proto,
    sampling_from_proto,
)

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """One request started on this stream, from its start message to its last entry."""

    req_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    is_local: bool = False  # a local prefill: its whole prompt is recorded at its first token
    t_start: float = field(default_factory=time.monotonic)  # its start message arrived
    t_add: float = 0.0  # the engine accepted it
    t_first: float | None = None  # its first tokens arrived here
    t_second: float | None = None  # its second token did
    num_tokens: int = 0
    num_cached_tokens: int = 0  # from its first delta
    output: list[int] | None = None  # kept where the worker records replies (finished())
    is_open: bool = False  # in the engine: its deltas come to the sink
    is_aborted: bool = False  # an abort came while it was starting
    span: object = None  # its tracing span, when the gateway traces it


class _Pending:
    """A request's news not sent yet: one or more steps' deltas merged."""

    __slots__ = ("token_ids", "texts", "logprobs", "end")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[dict[int, float]] | None = None
        self.end: pb.StreamEnd | None = None

DRAIN_POLL_S = 0.05  # while draining, how often a stream checks whether it may end


class OutputStream:
    """See the module docstring. Create and run it inside the worker's event loop."""

    def __init__(self, worker: DecodeWorker,
                 reserve: Callable[[pb.ReserveRequest], Awaitable[pb.ReserveResponse]],
                 ready_timeout_s: float = 5.0) -> None:
        """reserve: the Reserve call's answer, or Refused (decode_service/service.py)."""
        self.worker = worker
        self._reserve = reserve
        self.ready_timeout_s = ready_timeout_s
        self.requests: dict[str, _Request] = {}  # started, not ended
        self.pending: dict[str, _Pending] = {}  # news not written yet, in arrival order
        self.answers: list[pb.StreamReserved] = []  # reserve answers not written yet
        # req_id -> None, or why an abort for it came: its reserve message is being answered
        self.reserving: dict[str, str | None] = {}
        self.reserved: dict[str, str] = {}  # req_id -> lease_id: reserved here, not started
        self._is_closed = False
        self._wake = asyncio.Event()
        self._is_reading = True
        self.is_draining = False  # the worker stops: no new requests, end once idle
        self._starting: set[asyncio.Task] = set()
        self._keeps_replies = worker.engine.kv.cache_decoded_blocks

    # -- the gateway's messages ---------------------------------------------------------------
    async def read(self, context) -> None:
        """Take start and abort messages until the gateway closes its side."""
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    return
                self.handle(msg)
        finally:
            self._is_reading = False
            self._wake.set()

    def handle(self, msg: pb.StreamRequest) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "abort":
            self._abort(msg.abort.request_id, msg.abort.reason or "aborted by the gateway")
            return
        if kind == "reserve":
            self.reserving[msg.reserve.request_id] = None
            self._track(self._answer(msg.reserve, tracing.continue_call(
                tracing.STREAM_CALLS[kind], msg.trace_context)))
            return
        inner = getattr(msg, kind)
        req_id = inner.request_id
        self.reserved.pop(req_id, None)  # started: its claim or withdrawal ends it now
        if req_id in self.requests:
            self._end_with_error(_Request(req_id), grpc.StatusCode.ALREADY_EXISTS,
                                 f"request_id {req_id!r} is already running on this stream")
            return
        rec = self.requests[req_id] = _Request(req_id, is_local=kind == "prefill_locally")
        if msg.trace_context:
            rec.span = tracing.continue_call(tracing.STREAM_CALLS[kind], msg.trace_context)
        if self._keeps_replies:
            rec.output = []
        if self.is_draining and kind != "fork" and req_id not in self.worker.reservations:
            # (what was reserved here before the drain still starts, and a fork of a request
            # running here: the gateway placed them here, and moving them would run them again)
            self._end_with_error(rec, grpc.StatusCode.UNAVAILABLE,
                                 "the decode worker is shutting down")
            return
        self._track(self._start(rec, kind, inner))

    def _track(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _answer(self, request: pb.ReserveRequest, span) -> None:
        """Reserve, and queue the answer for the writer."""
        entry = pb.StreamReserved(request_id=request.request_id)
        try:
            entry.reservation.CopyFrom(await self._reserve(request))
        except Refused as e:
            entry.error_code, entry.error = e.code.value[0], str(e)
        except Exception as e:  # a bug: the call fails UNKNOWN (grpc's own answer); so here
            logger.exception("reserving %r failed", request.request_id)
            entry.error_code, entry.error = grpc.StatusCode.UNKNOWN.value[0], repr(e)
        tracing.end_call(span, entry.error or None)
        aborted = self.reserving.pop(request.request_id, None)
        if self._is_closed or aborted is not None:  # nobody will start it
            if not entry.error_code:
                self.worker.release(request.request_id, entry.reservation.lease_id,
                                    aborted or "the gateway's stream ended")
            return
        if not entry.error_code:
            self.reserved[request.request_id] = entry.reservation.lease_id
        self.answers.append(entry)
        self._wake.set()

    async def _start(self, rec: _Request, kind: str, msg) -> None:
        try:
            if kind == "decode":
                first_lp = (logprob_from_proto(msg.first_logprob)
                            if msg.HasField("first_logprob") else None)
                inp, start = await self.worker.claim(
                    rec.req_id, msg.first_token_id, first_lp,
                    msg.ready_timeout_s or self.ready_timeout_s)
            elif kind == "prefill_locally":
                inp, start = self.worker.withdraw(rec.req_id, msg.lease_id,
                                                  msg.max_chunk_tokens)
            else:
                if not msg.parent_request_id:
                    raise ValueError("parent_request_id must be set")
                try:
                    params = sampling_from_proto(msg.sampling)
                except ValueError as e:
                    raise ValueError(f"sampling: {e}") from None
                inp = fork_input(rec.req_id, msg.parent_request_id,
                                 list(msg.prompt_token_ids), params)
                start = None
            if rec.is_aborted:
                raise _Aborted
            self._open(rec, inp, start)
        except _Aborted:
            self._end(rec, pb.StreamEnd(finish_reason=FINISH_REASONS["abort"]))
        except LeaseNotReady as e:
            self._end_with_error(rec, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except BackendUnavailable as e:
            self._end_with_error(rec, grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            self._end_with_error(rec, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _open(self, rec: _Request, inp: GenerateInput, start: StartRequest | None) -> None:
        rec.prompt_token_ids = inp.prompt_token_ids
        self.worker.open(inp, lambda item, t_step: self._take(rec, item, t_step), start,
                         on_add=lambda t: setattr(rec, "t_add", t))
        rec.is_open = True

    def _abort(self, req_id: str, reason: str) -> None:
        rec = self.requests.get(req_id)
        if rec is None:
            if req_id in self.reserving:  # (the gateway gave up waiting for the answer)
                self.reserving[req_id] = reason
                return
            lease_id = self.reserved.pop(req_id, None)
            if lease_id is not None:  # reserved here, not started
                self.worker.release(req_id, lease_id, reason)
            return
        if rec.is_open:  # its sink gets the abort, which ends it
            asyncio.ensure_future(self.worker.abort(req_id))
        else:  # still starting: end its reservation; the start ends it as aborted
            rec.is_aborted = True
            asyncio.ensure_future(self.worker.abort_anywhere(req_id, reason))

    # -- the engine's deltas (the loop, inside a step's dispatch) -----------------------------
    def _take(self, rec: _Request, item, t_step: float) -> None:
        if not isinstance(item, RequestDelta):
            if isinstance(item, BaseException):
                code = (grpc.StatusCode.INVALID_ARGUMENT if isinstance(item, ValueError)
                        else grpc.StatusCode.UNAVAILABLE)
                self._end_with_error(rec, code, str(item))
            else:  # ABORTED (worker.abort)
                self._end(rec, pb.StreamEnd(finish_reason=FINISH_REASONS["abort"]))
            return
        now = time.monotonic()
        if rec.t_first is None:  # a first delta that carries a decoded token too: the step
            rec.t_first = now if len(item.token_ids) < 2 else rec.t_start  # ran meanwhile
        rec.num_tokens += len(item.token_ids)
        if rec.t_second is None and rec.num_tokens >= 2:
            rec.t_second = now
        if rec.output is not None:
            rec.output += item.token_ids
        if item.is_first:
            rec.num_cached_tokens = item.num_cached_tokens
            if rec.is_local and item.token_ids:  # its whole prompt is computed, cached
                self.worker.held(rec.prompt_token_ids)
        entry = self.pending.get(rec.req_id)
        if entry is None:
            entry = self.pending[rec.req_id] = _Pending()
        entry.token_ids += item.token_ids
        entry.texts.append(item.text)
        if item.logprobs is not None:
            entry.logprobs = (entry.logprobs or []) + item.logprobs
        if item.finish_reason is not None:
            end = pb.StreamEnd(finish_reason=FINISH_REASONS[item.finish_reason],
                               num_cached_tokens=rec.num_cached_tokens,
                               first_decode_step_s=(rec.t_second - rec.t_first)
                               if rec.t_second else 0.0)
            if item.metrics is not None:  # the engine's split (local prefills and forks)
                m = item.metrics
                arrival = rec.t_add - rec.t_start
                end.queue_s = arrival + m.get("first_scheduled", 0.0)
                end.prefill_s = m.get("first_token", 0.0) - m.get("first_scheduled", 0.0)
            if rec.output is not None:
                self.worker.finished(rec.prompt_token_ids, rec.output)
            self._end(rec, end, entry)
        self._wake.set()

    def _end_with_error(self, rec: _Request, code: grpc.StatusCode, message: str) -> None:
        self._end(rec, pb.StreamEnd(error_code=code.value[0], error=message))

    def _end(self, rec: _Request, end: pb.StreamEnd, entry: _Pending | None = None) -> None:
        """The request's last entry; it leaves this stream (and the engine's sinks)."""
        if entry is None:
            entry = self.pending.get(rec.req_id) or self.pending.setdefault(rec.req_id,
                                                                            _Pending())
        entry.end = end
        if rec.span is not None:
            _trace_phases(rec)
            tracing.end_call(rec.span, end.error or None)
            rec.span = None
        if self.requests.get(rec.req_id) is rec:
            del self.requests[rec.req_id]
        if rec.is_open:
            rec.is_open = False
            self.worker.close_request(rec.req_id, abort=False)
        self._wake.set()

    # -- the writer -----------------------------------------------------------------------------
    async def write(self, context) -> None:
        """Send what is pending, step after step, until the gateway has closed its side and
        nothing is open or pending (or the call is cancelled)."""
        while True:
            if self.is_draining:  # (a reservation may end without news on this stream)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), DRAIN_POLL_S)
            else:
                await self._wake.wait()
            self._wake.clear()
            if self.pending or self.answers:
                pending, self.pending = self.pending, {}
                answers, self.answers = self.answers, []
                await context.write(_message(pending, answers))
            # (checked after a write too: the last request's end may be what was just sent,
            # and no later wake-up would come)
            if not self.pending and not self.requests and not self.answers and (
                    not self._is_reading or self.is_draining and not self.worker.reservations):
                return

    def drain(self) -> None:
        """The worker is shutting down: refuse new requests (but those reserved here before,
        and forks), end the stream once the open ones have ended and nothing reserved here
        is left to start."""
        self.is_draining = True
        self._wake.set()

    def close(self) -> None:
        """The stream ended: abort every request still open or starting on it, and end the
        reservations made on it that have not started (and those still being made)."""
        self._is_closed = True
        for req_id, lease_id in self.reserved.items():
            self.worker.release(req_id, lease_id, "the gateway's stream ended")
        self.reserved.clear()
        self.answers.clear()
        for rec in list(self.requests.values()):
            tracing.end_call(rec.span, "the gateway's stream ended")
            if rec.is_open:
                rec.is_open = False
                self.worker.close_request(rec.req_id, abort=True)
            else:
                rec.is_aborted = True
                asyncio.ensure_future(self.worker.abort_anywhere(
                    rec.req_id, "the gateway's stream ended"))
        self.requests.clear()
        self.pending.clear()


def _trace_phases(rec: _Request) -> None:
    now = time.monotonic()
    if rec.t_add:
        tracing.phase("claim", rec.t_start, rec.t_add, parent=rec.span)
    if rec.t_first is not None:
        if rec.t_second is not None:
            tracing.phase("first_decode_step", rec.t_first, rec.t_second, parent=rec.span)
        tracing.phase("stream", rec.t_first, now, parent=rec.span)


class _Aborted(Exception):
    """An abort came for a request while it was starting."""


class Refused(Exception):
    """A reservation not made: the status the Reserve call ends with (`code`), the message
    its details."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _message(pending: dict[str, _Pending], answers: list[pb.StreamReserved]) -> pb.StepOutputs:
    msg = pb.StepOutputs(reserved=answers)
    ids, counts, tokens, texts, num_logprobs = [], [], [], [], []
    for i, (req_id, entry) in enumerate(pending.items()):
        ids.append(req_id)
        counts.append(len(entry.token_ids))
        tokens += entry.token_ids
        texts.append("".join(entry.texts))
        if entry.logprobs is not None:
            lps = [logprob_to_proto(t, e)
                   for t, e in zip(entry.token_ids, entry.logprobs, strict=False)]
            msg.logprobs.extend(lps)
            num_logprobs.append(len(lps))
        else:
            num_logprobs.append(0)
        if entry.end is not None:
            entry.end.index = i
            msg.ends.append(entry.end)
    msg.request_ids.extend(ids)
    msg.num_tokens.extend(counts)
    msg.token_ids.extend(tokens)
    msg.texts.extend(texts)
    if msg.logprobs:
        msg.num_logprobs.extend(num_logprobs)
    return msg
