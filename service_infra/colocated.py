"""The colocated backend: one `LLMEngine` in this process, the baseline disaggregation is
measured against.

    event loop (gateway)                           engine thread
    generate(): register stream, submit add  ---->  inbox -> engine.add_request
                                                    engine.step() while work remains
    stream.queue <--- call_soon_threadsafe(dispatch(outputs of one step))
    abort / cancel: submit abort             ---->  inbox -> engine.abort_request

engine_core has no asyncio and is not thread-safe, so exactly one thread touches the engine:
every add, abort and status query goes through the inbox and runs between two steps. The
thread sleeps on a condition while there is nothing to do (no busy-waiting) and posts each
step's deltas (engine_core/outputs.py) to the event loop with one `call_soon_threadsafe`,
whatever the batch size; there each request's delta goes to its sink, a plain function.

The decode worker (decode_service/worker.py) builds on four public verbs: `call_in_engine`
(await a function run between two steps), `submit_to_engine` (queue one, from any thread),
`generate(inp, start=...)` (stream a request that enters the engine some other way than
`add_request`: admitted with KV and a first token computed elsewhere) and `open(inp, sink,
start)`, which `generate` is built on: the request's deltas go to `sink` as each step posts
them, with no task or queue of its own (the decode worker's per-gateway stream,
decode_service/stream.py, gathers every request's deltas of a step into one message).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine_core.engine import LLMEngine
from engine_core.outputs import RequestDelta
from service_infra.backend import (
    BackendUnavailable,
    DeadlineExceeded,
    DuplicateRequestError,
    GenerateChunk,
    GenerateInput,
    ModelInfo,
    Overloaded,
    Timing,
)

logger = logging.getLogger(__name__)

# Runs in the engine thread and puts one request into the engine; returns the deltas the
# engine produced for it at once (none for a request that waits for its first step).
StartRequest = Callable[[], list[RequestDelta]]
# Takes a request's deltas on the event loop, with the time of the step that made each, or a
# BaseException that ends the request (a start that failed, the engine's failure, closing).
# Must not block; it is called inside the step's dispatch.
Sink = Callable[[Any, float], None]

ABORTED = "aborted"  # what a sink gets when abort() ends its request
_DEADLINE = "deadline"  # generate()'s own, from its deadline timer


class _Stream:
    """The event-loop side of one request. `t_add` is written by the engine thread before any
    output of the request is posted, so the loop reads it after that write."""

    def __init__(self, inp: GenerateInput) -> None:
        self.inp = inp
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.t_add = inp.arrival  # when the engine accepted it (time.monotonic())
        self.t_scheduled: float | None = None
        self.t_first_token: float | None = None
        self.t_second_token: float | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def accepted(self, t_add: float) -> None:
        """The engine thread, as it accepts the request (before any of its outputs)."""
        self.t_add = t_add


class ColocatedBackend:
    """A Backend (service_infra/backend.py) over an LLMEngine; create it inside the running loop."""

    def __init__(self, engine: LLMEngine, model_name: str | None = None,
                 max_waiting: int | None = None) -> None:
        """max_waiting: requests allowed to wait for their first token at once (queued or in
        prefill); one more gets Overloaded (RESOURCE_EXHAUSTED, HTTP 429). None: no bound."""
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.max_waiting = max_waiting
        if engine.tokenizer is None:
            raise ValueError("the colocated backend needs an engine with a tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # one request must fit in the KV pool, or the scheduler could never admit it
        pool_tokens = engine.kv.pool.num_blocks * engine.kv.block_size
        self.model = ModelInfo(model_name or engine.source.name,
                               min(engine.max_model_len, pool_tokens),
                               engine.model_config.vocab_size)
        self.loop = asyncio.get_running_loop()  # where every stream and future lives
        self._streams: dict[str, _Stream] = {}  # generate()'s requests; loop side only
        self._sinks: dict[str, Sink] = {}  # every open request's; loop side only
        self._cv = threading.Condition()
        self._inbox: list[Callable[[], None]] = []  # guarded by _cv, run by the engine thread
        self._closed = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- the Backend interface (event loop) -----------------------------------------------
    async def generate(self, inp: GenerateInput, *,
                       start: StartRequest | None = None) -> AsyncIterator[GenerateChunk]:
        """The Backend contract (service_infra/backend.py). start: how the engine thread puts
        the request into the engine, instead of `engine.add_request(inp.prompt_token_ids,
        inp.params)`; a ValueError it raises ends the stream with that error."""
        if inp.req_id in self._sinks:
            raise DuplicateRequestError(f"request_id {inp.req_id!r} is already running")
        if self.max_waiting is not None:
            waiting = sum(1 for s in self._streams.values() if s.t_first_token is None)
            if waiting >= self.max_waiting:
                raise Overloaded(f"{waiting} requests already wait for their first token on "
                                 f"this engine (max_waiting {self.max_waiting})")
        stream = _Stream(inp)
        self._streams[inp.req_id] = stream
        put = stream.queue.put_nowait
        try:
            self.open(inp, lambda item, t_step: put((item, t_step)), start,
                      on_add=stream.accepted)
        except BaseException:
            del self._streams[inp.req_id]
            raise
        timer = None
        if inp.deadline is not None:
            timer = self.loop.call_later(max(0.0, inp.deadline - time.monotonic()),
                                          put, (_DEADLINE, 0.0))
        is_done = False
        try:
            while not is_done:
                items = [await stream.queue.get()]
                while not stream.queue.empty():  # a slow consumer gets one merged chunk
                    items.append(stream.queue.get_nowait())
                chunk = self._merge(stream, items)
                is_done = chunk.is_last
                yield chunk
        finally:
            if timer is not None:
                timer.cancel()
            del self._streams[inp.req_id]
            self.close_request(inp.req_id, abort=not is_done)

    def open(self, inp: GenerateInput, sink: Sink, start: StartRequest | None = None,
             on_add: Callable[[float], None] | None = None) -> None:
        """Put the request into the engine (by `start`, or add_request) and send each of its
        deltas to `sink` on this loop until its last; then, or when the caller is done with
        it, `close_request`. DuplicateRequestError if its id is open, BackendUnavailable if
        the engine takes no more. on_add(time): in the engine thread, as it accepts it."""
        if inp.req_id in self._sinks:
            raise DuplicateRequestError(f"request_id {inp.req_id!r} is already running")
        self._sinks[inp.req_id] = sink
        if not self.submit_to_engine(lambda: self._add(inp, start, on_add)):
            del self._sinks[inp.req_id]
            raise self._unavailable()

    def close_request(self, req_id: str, abort: bool) -> None:
        """Stop sending the request's deltas; abort it in the engine too when it has not
        ended (cancelled, closed early, deadline, an error)."""
        self._sinks.pop(req_id, None)
        if abort:
            self.submit_to_engine(lambda: self.engine.abort_request(req_id))

    async def abort(self, req_id: str) -> bool:
        sink = self._sinks.get(req_id)
        if sink is None:
            return False
        self.submit_to_engine(lambda: self.engine.abort_request(req_id))
        sink(ABORTED, time.monotonic())
        return True

    async def status(self) -> dict[str, Any]:
        def snapshot() -> dict[str, Any]:
            sched, kv = self.engine.scheduler, self.engine.kv
            # structured outputs' mask time (an engine without a model runner has none)
            mask = getattr(getattr(self.engine, "runner", None), "mask_timer", None)
            stats = getattr(self.engine, "stats", None)
            integrity = "not checked (busy)"  # the check walks every block: only at idle
            if not self.engine.has_unfinished_requests():
                try:
                    kv.check_integrity()
                    integrity = "ok"
                except (AssertionError, ValueError) as e:
                    integrity = f"broken: {e}"
            return {"mode": "colocated", "num_running": sched.num_running,
                    "num_waiting": sched.num_waiting, "num_free_blocks": kv.num_free_blocks,
                    "num_blocks": kv.pool.num_blocks, "num_preemptions": sched.num_preemptions,
                    "kv_integrity": integrity,
                    # prompt tokens computed, and samples forked from another's prompt KV
                    # (an engine without stats has computed nothing)
                    **({"num_prompt_tokens_computed": stats.num_prompt_tokens,
                        "num_forks": sched.num_forks} if stats is not None else {}),
                    **({"grammar_mask": {"num_steps": mask.num_steps, "seconds": mask.seconds}}
                       if mask is not None else {}),
                    **({"speculative": self.engine.spec.stats.as_dict()}
                       if self.engine.spec is not None else {}),
                    **({"kv_offload": self.engine.offloader.status()}
                       if getattr(self.engine, "offloader", None) is not None else {})}

        result = await self.call_in_engine(snapshot)
        result["num_streams"] = len(self._sinks)
        return result

    def status_now(self) -> dict[str, Any]:
        """The counters as they are, read from this thread without waiting for the engine
        step in progress (a long prefill step takes seconds): each number is consistent on
        its own, not with the others while requests run. Workers answer Status with this, so
        a busy worker answers at once and only a stalled one times out."""
        sched, kv = self.engine.scheduler, self.engine.kv
        return {"num_running": sched.num_running, "num_waiting": sched.num_waiting,
                "num_free_blocks": kv.num_free_blocks, "num_blocks": kv.pool.num_blocks,
                **({"speculative": self.engine.spec.stats.as_dict()}
                   if self.engine.spec is not None else {})}

    async def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify()
        self._fail_streams(BackendUnavailable("the backend is shutting down"))
        await asyncio.to_thread(self._thread.join)

    # -- the engine thread's inbox (public: subclasses and wrappers build on it) --------------
    async def call_in_engine(self, fn: Callable[[], Any]) -> Any:
        """Run fn in the engine thread between two steps and return its result, or raise its
        exception here; BackendUnavailable once the backend is closed or failed. Event loop
        only."""
        fut = self.loop.create_future()

        def run() -> None:
            try:
                result, error = fn(), None
            except Exception as e:  # handed to the caller
                result, error = None, e
            self.loop.call_soon_threadsafe(_settle, fut, result, error)

        if not self.submit_to_engine(run):
            raise self._unavailable()
        return await fut

    def submit_to_engine(self, command: Callable[[], None]) -> bool:
        """Queue a command for the engine thread, which runs the queue in order between two
        steps; False once it takes no more (closed or failed). Thread-safe, never waits for a
        step."""
        with self._cv:
            if self._closed or self._failure is not None:
                return False
            self._inbox.append(command)
            self._cv.notify()
            return True

    # -- event loop helpers ------------------------------------------------------------------
    def _merge(self, stream: _Stream, items: list[Any]) -> GenerateChunk:
        """Fold queued items ((delta, step time), sentinels, errors) into one chunk."""
        token_ids: list[int] = []
        texts: list[str] = []
        logprobs: list[dict[int, float]] | None = None
        finish_reason = None
        prompt_logprobs = None
        finished_s = None
        for item, t_step in items:
            if item is ABORTED:
                finish_reason = "abort"
                break
            if item is _DEADLINE:
                raise DeadlineExceeded(f"request {stream.inp.req_id!r} passed its deadline")
            if isinstance(item, BaseException):
                raise item
            delta: RequestDelta = item
            if delta.is_first:
                metrics = delta.metrics or {}
                stream.t_scheduled = stream.t_add + metrics.get("first_scheduled", 0.0)
                stream.t_first_token = stream.t_add + metrics.get("first_token", 0.0)
                stream.num_cached_tokens = delta.num_cached_tokens
                prompt_logprobs = delta.prompt_logprobs
            elif stream.t_second_token is None and delta.token_ids:
                stream.t_second_token = t_step
            if delta.logprobs is not None:
                logprobs = (logprobs or []) + delta.logprobs
            stream.num_output_tokens = delta.num_output_tokens
            token_ids += delta.token_ids
            texts.append(delta.text)
            finish_reason = delta.finish_reason
            if finish_reason is not None and delta.metrics is not None:
                finished_s = delta.metrics.get("finished")
        chunk = GenerateChunk(token_ids, "".join(texts), logprobs, finish_reason,
                              len(stream.inp.prompt_token_ids), stream.num_output_tokens,
                              stream.num_cached_tokens, prompt_logprobs=prompt_logprobs)
        if finish_reason is not None:
            t_end = time.monotonic() if finished_s is None else stream.t_add + finished_s
            chunk.timing = _timing(stream, t_end)
        return chunk

    def _dispatch(self, deltas: list[RequestDelta], t_step: float) -> None:
        sinks = self._sinks
        for delta in deltas:
            sink = sinks.get(delta.req_id)
            if sink is not None:  # else: aborted or closed since the step began
                sink(delta, t_step)

    def _post_error(self, req_id: str, error: BaseException) -> None:
        sink = self._sinks.get(req_id)
        if sink is not None:
            sink(error, time.monotonic())

    def _fail_streams(self, error: BaseException) -> None:
        now = time.monotonic()
        for sink in list(self._sinks.values()):
            sink(error, now)

    def _unavailable(self) -> BackendUnavailable:
        if self._failure is not None:
            return BackendUnavailable(f"the engine failed: {self._failure!r}")
        return BackendUnavailable("the backend is shut down")

    # -- the engine thread ----------------------------------------------------------------------
    def _add(self, inp: GenerateInput, start: StartRequest | None,
             on_add: Callable[[float], None] | None) -> None:
        if on_add is not None:
            on_add(time.monotonic())
        try:
            if start is None:
                self.engine.add_request(inp.prompt_token_ids, inp.params, req_id=inp.req_id,
                                        num_prior_output_tokens=inp.num_prior_output_tokens,
                                        fork_of=inp.fork_of)
                outputs = []
            else:
                outputs = start()
        except ValueError as e:
            self.loop.call_soon_threadsafe(self._post_error, inp.req_id, e)
            return
        if outputs:
            self.loop.call_soon_threadsafe(self._dispatch, outputs, time.monotonic())

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._inbox or self._closed or engine.has_unfinished_requests()):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                is_closed = self._closed
            try:
                for command in inbox:
                    command()
                if is_closed:  # streams were told; what still runs is dropped
                    engine.abort_request(list(engine.scheduler.requests))
                    engine.close()  # queued KV stores finish (offload tiers)
                    return
                outputs = engine.step_deltas() if engine.has_unfinished_requests() else []
            except Exception as e:  # the model or scheduler broke: fail everything, stop
                self._fail(e)
                return
            if outputs:
                self.loop.call_soon_threadsafe(self._dispatch, outputs, time.monotonic())
            elif engine.has_unfinished_requests() and engine.scheduler.num_running == 0:
                # waiting requests that cannot be admitted yet (ModelInfo.max_model_len keeps a
                # single request within the pool): nap instead of spinning
                with self._cv:
                    self._cv.wait(0.01)

    def _fail(self, error: Exception) -> None:
        logger.exception("the engine failed; failing every request")
        with self._cv:
            self._failure = error
            inbox, self._inbox = self._inbox, []
        for command in inbox:  # settle pending status calls; adds are failed below anyway
            try:
                command()
            except Exception:
                logger.debug("command after engine failure raised", exc_info=True)
        self.loop.call_soon_threadsafe(self._fail_streams, self._unavailable())


def _timing(stream: _Stream, t_end: float) -> Timing:
    arrival = stream.inp.arrival
    t_sched, t_first, t_second = stream.t_scheduled, stream.t_first_token, stream.t_second_token
    if t_sched is None or t_first is None:  # ended before its first token
        return Timing(t_end - arrival, 0.0, 0.0, 0.0, 0.0, t_end - arrival)
    return Timing(queue_s=t_sched - arrival, prefill_s=t_first - t_sched, kv_transfer_s=0.0,
                  first_decode_step_s=0.0 if t_second is None else t_second - t_first,
                  ttft_s=t_first - arrival, total_s=t_end - arrival)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
