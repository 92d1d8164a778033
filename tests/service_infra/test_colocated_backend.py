"""ColocatedBackend over a fake engine (no model, milliseconds): streaming, cancellation,
deadlines, abort by id, engine failure, and an idle engine thread that does not spin."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from engine_core.outputs import RequestDelta
from engine_core.sampling_params import SamplingParams
from service_infra.backend import (
    BackendUnavailable,
    DeadlineExceeded,
    DuplicateRequestError,
    GenerateInput,
    Overloaded,
)
from service_infra.colocated import ColocatedBackend
from tests.service_infra.fake_engine import FakeEngine


def inp(req_id: str, max_tokens: int, deadline: float | None = None) -> GenerateInput:
    return GenerateInput(req_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens),
                         deadline=deadline)


def run(coro_fn, engine: FakeEngine | None = None):
    async def main():
        backend = ColocatedBackend(engine or FakeEngine())
        try:
            return await coro_fn(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


async def collect(backend, i):
    return [c async for c in backend.generate(i)]


def test_streams_every_token_then_the_timing():
    chunks = run(lambda b: collect(b, inp("a", 5)))
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5]
    assert "".join(c.text_delta for c in chunks) == "t1 t2 t3 t4 t5 "
    last = chunks[-1]
    assert last.finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert (last.num_prompt_tokens, last.num_output_tokens) == (3, 5)
    t = last.timing
    assert t.ttft_s == pytest.approx(t.queue_s + t.prefill_s) and t.first_decode_step_s > 0



def test_a_request_can_enter_the_engine_another_way():
    """generate(start=...): the engine thread runs start instead of add_request (the decode
    worker admits a prefilled request so); what start returns streams first, and a ValueError
    it raises ends the stream with that error."""
    engine = FakeEngine()
    seen_threads: list[str] = []

    def admit() -> list[RequestDelta]:
        seen_threads.append(threading.current_thread().name)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), "p")
        engine.scheduler.requests["p"][2].append(0)  # the first token, computed elsewhere
        return [RequestDelta("p", [0], "t0 ", 1, is_first=True,
                             metrics={"first_scheduled": 0.0, "first_token": 0.0})]

    def refuse() -> list[RequestDelta]:
        raise ValueError("cannot admit: no reservation")

    async def body(backend):
        chunks = [c async for c in backend.generate(inp("p", 4), start=admit)]
        with pytest.raises(ValueError, match="no reservation"):
            [c async for c in backend.generate(inp("q", 4), start=refuse)]
        return chunks

    chunks = run(body, engine)
    assert [t for c in chunks for t in c.token_ids] == [0, 2, 3, 4]
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 4
    assert seen_threads == ["engine-loop"]

def test_concurrent_requests_and_a_duplicate_id():
    async def body(backend):
        results = await asyncio.gather(*(collect(backend, inp(f"r{i}", 3 + i)) for i in range(4)))
        gen = backend.generate(inp("x", 50))
        await anext(gen)
        with pytest.raises(DuplicateRequestError):
            await anext(backend.generate(inp("x", 5)))
        await gen.aclose()
        return results

    results = run(body)
    assert [sum(len(c.token_ids) for c in r) for r in results] == [3, 4, 5, 6]


def test_closing_the_stream_early_aborts_in_the_engine():
    engine = FakeEngine()

    async def body(backend):
        async with contextlib.aclosing(backend.generate(inp("a", 1000))) as chunks:
            async for _ in chunks:
                break
        for _ in range(100):
            status = await backend.status()
            if status["num_running"] == 0:
                return status
            await asyncio.sleep(0.01)

    assert run(body, engine)["num_streams"] == 0 and engine.aborted == ["a"]


def test_cancelled_consumer_aborts_in_the_engine():
    engine = FakeEngine()

    async def body(backend):
        task = asyncio.create_task(collect(backend, inp("a", 1000)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await backend.status()  # runs in the engine thread after the abort
        return engine.aborted

    assert run(body, engine) == ["a"]


def test_deadline_raises_and_aborts():
    engine = FakeEngine()

    async def body(backend):
        with pytest.raises(DeadlineExceeded):
            await collect(backend, inp("a", 1000, deadline=time.monotonic() + 0.05))
        await backend.status()
        return engine.aborted

    assert run(body, engine) == ["a"]


def test_abort_by_id_ends_the_stream():
    async def body(backend):
        gen = backend.generate(inp("a", 1000))
        first = await anext(gen)
        assert await backend.abort("a") and not await backend.abort("nope")
        rest = [c async for c in gen]
        return first, rest

    first, rest = run(body)
    assert rest[-1].finish_reason == "abort" and rest[-1].timing is not None


def test_engine_failure_fails_streams_and_later_requests():
    engine = FakeEngine()

    async def body(backend):
        gen = backend.generate(inp("a", 1000))
        await anext(gen)
        engine.fail = True
        with pytest.raises(BackendUnavailable):
            async for _ in gen:
                pass
        with pytest.raises(BackendUnavailable):
            await anext(backend.generate(inp("b", 5)))
        with pytest.raises(BackendUnavailable):
            await backend.status()

    run(body, engine)


def test_idle_engine_thread_does_not_spin():
    engine = FakeEngine()

    async def body(backend):
        await collect(backend, inp("a", 3))
        await backend.status()
        steps = engine.num_steps
        await asyncio.sleep(0.2)
        return steps, engine.num_steps

    before, after = run(body, engine)
    assert before == after == 3


def test_a_full_queue_refuses_the_next_request():
    """max_waiting bounds the requests waiting for their first token: one more is refused at
    once (Overloaded: RESOURCE_EXHAUSTED, HTTP 429), not queued; room comes back as soon as
    a waiting request gets its first token."""
    engine = FakeEngine(step_s=0.3)

    async def body(backend):
        gens = [backend.generate(inp(f"w{i}", 3)) for i in range(2)]
        firsts = [asyncio.create_task(anext(g)) for g in gens]
        await asyncio.sleep(0.05)  # both submitted, no step finished yet
        with pytest.raises(Overloaded, match=r"2 requests already wait .* \(max_waiting 2\)"):
            await anext(backend.generate(inp("x", 3)))
        assert [len((await f).token_ids) for f in firsts] == [1, 1]
        later = await collect(backend, inp("y", 2))  # the waiting ones started: room again
        for g in gens:
            await g.aclose()
        return later

    async def main():
        backend = ColocatedBackend(engine, max_waiting=2)
        try:
            return await body(backend)
        finally:
            await backend.close()

    later = asyncio.run(main())
    assert [t for c in later for t in c.token_ids] == [1, 2]
    assert "x" not in engine.aborted  # refused before it reached the engine
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        asyncio.run(_make(engine, 0))


async def _make(engine, max_waiting):
    return ColocatedBackend(engine, max_waiting=max_waiting)
