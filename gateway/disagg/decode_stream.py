"""This gateway's output stream to one decode worker (Decode.Stream,
decode_service/stream.py): every request it decodes there reserves, starts and streams
through it.

    reserve(ReserveRequest)    -> the ReserveResponse, as the Reserve call returns it (or its
                                  error); the worker answers as soon as it has reserved
    start(req_id, decode | prefill_locally | fork) -> a RequestChannel; the start message goes
                                  out through the stream's one writer
    the reader, per message       one StepOutputs: every request's news of a step, handed to
                                  its channel (a list append and at most one wake-up)
    RequestChannel, iterated      the request's news as DecodeDelta, several steps merged when
                                  its consumer is slower than the steps (its own back-pressure:
                                  a slow client never holds the others up)

A channel ends with its request's last entry; an error entry raises the status its own RPC
would have (grpc.aio.AioRpcError), and so does the deadline (DEADLINE_EXCEEDED) and the
stream's failure (the worker died or is unreachable: UNAVAILABLE, every channel on it).
When the gateway traces the request, its reservation and its start are CLIENT spans named
for the RPCs they stand for (pdserve.internal.Decode/Reserve, ended with the answer;
/Decode, /PrefillLocally, /Fork, ended with the channel).
The stream is opened on first use and again after it failed; its end aborts, on the worker,
whatever still runs on it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field

import grpc

from protos.pdserve.internal import workers_pb2 as pb
from service_infra import tracing
from service_infra.proto_convert import logprob_from_proto

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeDelta:
    """A request's news since its channel last yielded (DecodeResponse's fields)."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: int = 0  # pdserve.v1.FinishReason; 0 while running
    num_cached_tokens: int = 0
    first_decode_step_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    ends: bool = field(default=False, repr=False)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RequestChannel:
    """One request's news on the stream; iterate it (see the module docstring)."""

    def __init__(self, connection: _Connection, req_id: str, deadline: float | None) -> None:
        self._connection = connection
        self.req_id = req_id
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._is_done = False
        self.span = None  # its tracing span (tracing.start_call), ended with the channel
        self._timer = (None if deadline is None else asyncio.get_running_loop().call_at(
            deadline, self.push_error, _error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                              "Deadline Exceeded")))

    @property
    def is_done(self) -> bool:
        """Its last entry has been yielded, or it failed."""
        return self._is_done

    def push(self, item) -> None:
        """A DecodeDelta or an exception; from the stream's reader."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def push_error(self, error: BaseException) -> None:
        self.push(error)

    def __aiter__(self) -> RequestChannel:
        return self

    async def __anext__(self) -> DecodeDelta:
        if self._is_done:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        first = self._items.popleft()
        if isinstance(first, BaseException):
            self.close(error=first)
            raise first
        while self._items and not first.ends:  # a slow consumer: the steps merged
            item = self._items[0]
            if isinstance(item, BaseException):
                break
            self._items.popleft()
            first = _merge(first, item)
        if first.ends:
            self.close()
        return first

    def close(self, error: BaseException | None = None) -> None:
        """No more news wanted: the channel leaves the stream (idempotent)."""
        if self.span is not None:
            tracing.end_call(self.span, None if error is None else str(error))
            self.span = None
        self._is_done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._connection.channels.pop(self.req_id, None)


def _merge(a: DecodeDelta, b: DecodeDelta) -> DecodeDelta:
    a.token_ids += b.token_ids
    a.text += b.text
    if b.logprobs is not None:
        a.logprobs = (a.logprobs or []) + b.logprobs
    if b.ends:
        a.finish_reason, a.ends = b.finish_reason, True
        a.num_cached_tokens, a.first_decode_step_s = b.num_cached_tokens, b.first_decode_step_s
        a.queue_s, a.prefill_s = b.queue_s, b.prefill_s
    return a


class _Connection:
    """One Stream call and the channels started on it."""

    def __init__(self, stub) -> None:
        self.call = stub.Stream()
        self.channels: dict[str, RequestChannel] = {}
        self.reserving: dict[str, asyncio.Future] = {}  # req_id -> its StreamReserved, to come
        self.is_broken = False
        self._outbox: collections.deque[pb.StreamRequest] = collections.deque()
        self._has_mail = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def send(self, msg: pb.StreamRequest) -> None:
        self._outbox.append(msg)
        self._has_mail.set()

    async def _write(self) -> None:
        """The stream's one writer (a gRPC stream takes one write at a time)."""
        try:
            while True:
                await self._has_mail.wait()
                self._has_mail.clear()
                while self._outbox:
                    await self.call.write(self._outbox.popleft())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the reader sees the call's end and fails the channels

    async def _read(self) -> None:
        error: BaseException = _error(grpc.StatusCode.UNAVAILABLE,
                                      "the decode worker ended the output stream")
        try:
            async for msg in self.call:
                self._dispatch(msg)
        except grpc.aio.AioRpcError as e:
            error = _error(grpc.StatusCode.UNAVAILABLE if e.code() == grpc.StatusCode.CANCELLED
                           else e.code(), e.details() or "the output stream failed")
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the gateway closed the output stream")
            raise
        finally:
            self.is_broken = True
            self._writer.cancel()
            for channel in list(self.channels.values()):
                channel.push(error)
            self.channels.clear()
            for waiter in self.reserving.values():
                if not waiter.done():
                    waiter.set_exception(error)
            self.reserving.clear()

    def _dispatch(self, msg: pb.StepOutputs) -> None:
        for entry in msg.reserved:
            waiter = self.reserving.pop(entry.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(entry)
        channels = self.channels
        tokens = list(msg.token_ids)
        texts = msg.texts
        counts = msg.num_tokens
        ends = {e.index: e for e in msg.ends} if msg.ends else None
        num_logprobs = msg.num_logprobs
        first_lp = first_token = 0
        for i, req_id in enumerate(msg.request_ids):
            n = counts[i]
            delta = DecodeDelta(tokens[first_token:first_token + n], texts[i])
            first_token += n
            if num_logprobs and num_logprobs[i]:
                k = num_logprobs[i]
                delta.logprobs = [logprob_from_proto(m)
                                  for m in msg.logprobs[first_lp:first_lp + k]]
                first_lp += k
            error = None
            if ends is not None and i in ends:
                end = ends[i]
                if end.error_code:
                    error = _sent_error(end.error_code, end.error)
                delta.ends = True
                delta.finish_reason = end.finish_reason
                delta.num_cached_tokens = end.num_cached_tokens
                delta.first_decode_step_s = end.first_decode_step_s
                delta.queue_s, delta.prefill_s = end.queue_s, end.prefill_s
            channel = channels.get(req_id)
            if channel is None:  # closed here meanwhile (cancelled, deadline)
                continue
            if error is None:
                channel.push(delta)
                continue
            if delta.token_ids or delta.text:  # what it made before it failed, then the error
                delta.ends = False
                channel.push(delta)
            channel.push(error)

    def close(self) -> None:
        self.call.cancel()


_STATUS_BY_VALUE = {s.value[0]: s for s in grpc.StatusCode}


def _sent_error(code: int, details: str) -> grpc.aio.AioRpcError:
    """The error a worker sent as a status code's value and its details."""
    return _error(_STATUS_BY_VALUE[code], details)


def _give_up(c: _Connection, req_id: str, reason: str) -> None:
    """No answer is awaited any more: an abort behind the reserve message, on the same stream
    (a unary Abort could overtake it), ends the reservation once it is made."""
    if not c.is_broken:  # else the worker ended what the stream reserved already
        c.send(pb.StreamRequest(abort=pb.AbortRequestRequest(request_id=req_id,
                                                             reason=reason)))


class DecodeStream:
    """This gateway's output stream to one decode worker; see the module docstring."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self._connection: _Connection | None = None

    def _live(self) -> _Connection:
        c = self._connection
        if c is None or c.is_broken:
            c = self._connection = _Connection(self._stub)
        return c

    async def reserve(self, request: pb.ReserveRequest,
                      timeout: float | None) -> pb.ReserveResponse:
        """Reserve on the worker: what the Reserve call returns, or the grpc.aio.AioRpcError
        it raises (also UNAVAILABLE when the stream fails, DEADLINE_EXCEEDED after `timeout`
        seconds)."""
        c = self._live()
        req_id = request.request_id
        if req_id in c.reserving:
            raise ValueError(f"request_id {req_id!r} is already reserving here")
        waiter = c.reserving[req_id] = asyncio.get_running_loop().create_future()
        msg = pb.StreamRequest(reserve=request)
        span = None
        if tracing.is_on():
            span, carrier = tracing.start_call(tracing.STREAM_CALLS["reserve"])
            msg.trace_context.update(carrier)
        c.send(msg)
        try:
            entry = await asyncio.wait_for(waiter, timeout)
            error = _sent_error(entry.error_code, entry.error) if entry.error_code else None
        except TimeoutError:
            error = _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            _give_up(c, req_id, "the reservation's deadline passed at the gateway")
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            tracing.end_call(span, "cancelled")
            _give_up(c, req_id, "the gateway cancelled the reservation")
            raise
        finally:
            if c.reserving.get(req_id) is waiter:
                del c.reserving[req_id]
        tracing.end_call(span, None if error is None else error.details())
        if error is not None:
            raise error
        return entry.reservation

    def start(self, req_id: str, deadline: float | None, *,
              decode: pb.DecodeRequest | None = None,
              prefill_locally: pb.LocalPrefillRequest | None = None,
              fork: pb.ForkRequest | None = None) -> RequestChannel:
        """Start the request on the worker (one of the three) and return its channel;
        `deadline`: time.monotonic() after which the channel fails DEADLINE_EXCEEDED."""
        c = self._live()
        if req_id in c.channels:
            raise ValueError(f"request_id {req_id!r} is already streaming here")
        channel = c.channels[req_id] = RequestChannel(c, req_id, deadline)
        msg = pb.StreamRequest(decode=decode, prefill_locally=prefill_locally, fork=fork)
        if tracing.is_on():
            method = tracing.STREAM_CALLS[msg.WhichOneof("kind")]
            channel.span, carrier = tracing.start_call(method)
            msg.trace_context.update(carrier)
        c.send(msg)
        return channel

    def abort(self, channel: RequestChannel, reason: str) -> None:
        """End a request started here early, on the worker too (its blocks are freed)."""
        c = channel._connection
        channel.close()
        if not c.is_broken:  # else the worker ended everything of the stream already
            c.send(pb.StreamRequest(abort=pb.AbortRequestRequest(
                request_id=channel.req_id, reason=reason)))

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
