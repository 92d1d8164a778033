"""The load loop against a fake `send`: concurrency, arrivals, time limit, the mixed lanes."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdserve.bench.metrics import RequestResult
from pdserve.bench.runner import Lane, run_lanes
from pdserve.bench.workloads import BenchRequest


def reqs(n: int, group: str = "main") -> list[BenchRequest]:
    return [BenchRequest(output_len=4, input_len=i + 1, group=group) for i in range(n)]


class FakeServer:
    """Answers every request after `seconds`; records how many run at once."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = seconds
        self.running = 0
        self.max_running = 0
        self.sent: list[tuple[str, float]] = []

    async def send(self, req: BenchRequest) -> RequestResult:
        self.sent.append((req.group, time.perf_counter()))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.running -= 1
        return RequestResult(group=req.group, is_success=True, input_len=req.input_len,
                             output_len=4, ttft=self.seconds / 2, latency=self.seconds)


def run(coro):
    return asyncio.run(coro)


def test_concurrency_is_a_limit_and_order_is_kept():
    server = FakeServer()

    async def go():
        return await run_lanes(server.send, [Lane(reqs(10), max_concurrency=3)], 10.0)

    results, duration = run(go())
    assert server.max_running == 3
    assert [r.input_len for r in results] == list(range(1, 11))
    assert all(r.is_success for r in results)
    assert 0.06 < duration < 2.0  # four waves of 20 ms
    assert [r.start for r in results] == sorted(r.start for r in results)


def test_poisson_arrivals_spread_the_requests():
    server = FakeServer(0.001)

    async def go():
        return await run_lanes(server.send, [Lane(reqs(20), request_rate=100.0)], 10.0, seed=1)

    results, duration = run(go())
    assert len(results) == 20
    assert 0.05 < duration < 1.0  # 19 gaps of 10 ms on average
    gaps = [b[1] - a[1] for a, b in zip(server.sent, server.sent[1:], strict=False)]
    assert len(set(round(g, 4) for g in gaps)) > 10  # random, not evenly spaced


def test_time_limit_cancels_and_counts_incomplete():
    server = FakeServer(10.0)

    async def go():
        return await run_lanes(server.send, [Lane(reqs(5), max_concurrency=2)], 0.2)

    t0 = time.perf_counter()
    results, duration = run(go())
    assert time.perf_counter() - t0 < 2.0 and duration == pytest.approx(0.2, abs=0.15)
    assert len(results) == 5
    assert all(r.is_incomplete and not r.is_success for r in results)
    assert "--max-duration" in results[0].error
    assert server.running == 0  # the cancelled sends were cleaned up


def test_mixed_decode_streams_run_until_the_long_lane_ends():
    server = FakeServer(0.02)

    async def go():
        long = Lane(reqs(2, "long"), request_rate=20.0)
        decode = Lane(reqs(500, "decode"), max_concurrency=4, until=long)
        return await run_lanes(server.send, [decode, long], 10.0, seed=0)

    results, _ = run(go())
    groups = [r.group for r in results]
    assert groups.count("long") == 2
    # decode streams kept going while the long prompts arrived, then stopped: far fewer than
    # the 500 available, at least one per stream, none counted as incomplete
    assert 4 <= groups.count("decode") < 100
    assert not any(r.is_incomplete for r in results)
    last_long = max(t for g, t in server.sent if g == "long")
    assert max(t for g, t in server.sent if g == "decode") <= last_long + 0.1


def test_lane_checks_its_arguments():
    with pytest.raises(ValueError, match="max_concurrency"):
        Lane([], max_concurrency=0)
    with pytest.raises(ValueError, match="request_rate"):
        Lane([], request_rate=0.0)


def test_a_conversation_sends_its_turns_in_order_with_the_answers():
    sent: list[BenchRequest] = []

    async def send(req: BenchRequest) -> RequestResult:
        sent.append(req)
        await asyncio.sleep(0.01)
        turn = len(req.messages) // 2 + 1
        return RequestResult(group=req.group, is_success=turn != 3 or "fail" not in
                             req.messages[0][1], output_len=2, ttft=0.005, latency=0.01,
                             text=f"answer {turn}")

    chats = [BenchRequest(4, 5, messages=(("user", f"chat {i}"),), group="first-turn",
                          follow_ups=("Why?", "And then?", "More?")) for i in range(3)]
    chats[2] = dataclasses.replace(chats[2], messages=(("user", "fail at turn 3"),))

    async def go():
        return await run_lanes(send, [Lane(chats, max_concurrency=2)], 10.0)

    results, _ = run(go())
    # chats 0 and 1: 4 turns each; chat 2 stops at its failed third turn
    assert [r.group for r in results] == ["first-turn"] + ["follow-up"] * 3 + \
        ["first-turn"] + ["follow-up"] * 3 + ["first-turn"] + ["follow-up"] * 2
    assert [r.is_success for r in results[-3:]] == [True, True, False]
    last = [r for r in sent if r.messages[0][1] == "chat 0"][-1]
    assert last.messages == (("user", "chat 0"), ("assistant", "answer 1"), ("user", "Why?"),
                             ("assistant", "answer 2"), ("user", "And then?"),
                             ("assistant", "answer 3"), ("user", "More?"))
    # two chats at a time: chat 2's first turn waits for a whole chat to end
    first_of_2 = next(i for i, r in enumerate(sent) if r.messages[0][1].startswith("fail"))
    assert first_of_2 >= 4
