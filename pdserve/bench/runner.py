"""The load loop: lanes of requests sent through a client, bounded in count and in time.

A lane issues its requests in order, at the arrivals of a Poisson process that starts with the
run (`request_rate` per second; inf: all at once), and at most `max_concurrency` of them run at a time: as in `vllm bench serve`, a
request waits for a free slot before it is sent, and its clock starts when it is sent. A lane
with `until` set (the mixed workload's decode streams) stops sending once `until` has finished
and every slot has sent at least one request: those streams decode for as long as the other
lane's long prompts keep arriving.

A request with follow-ups (the multi-turn workload) is a conversation: it holds its slot while
its turns go out one after the other, each once the previous answer has arrived, with that
answer in its history; every turn is a result of its own.

At `max_duration_s` everything still running or waiting is cancelled and counted as
`incomplete` (neither completed nor failed).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from pdserve.bench.metrics import RequestResult
from pdserve.bench.workloads import BenchRequest

Send = Callable[[BenchRequest], Awaitable[RequestResult]]


@dataclass
class Lane:
    requests: list[BenchRequest]
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf
    until: Lane | None = None  # stop sending once that lane has finished
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")


@dataclass
class _Issued:
    req: BenchRequest
    task: asyncio.Task | None = None  # None: never sent (time ran out first)
    results: list[RequestResult] = field(default_factory=list)  # one per turn sent
    is_skipped: bool = False  # an `until` lane that had sent enough


async def run_lanes(send: Send, lanes: list[Lane], max_duration_s: float, seed: int = 0,
                    desc: str = "requests") -> tuple[list[RequestResult], float]:
    """Results in issue order (lane by lane) and the run's duration in seconds."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    issued: list[list[_Issued]] = [[_Issued(r) for r in lane.requests] for lane in lanes]
    num_turns = sum(1 + len(r.follow_ups) for lane in lanes for r in lane.requests)
    with tqdm(total=num_turns, desc=desc, unit="req", leave=False) as bar:

        async def one(lane: Lane, item: _Issued, slots: asyncio.Semaphore, i: int) -> None:
            async with slots:
                if lane.until is not None and lane.until.done.is_set() \
                        and i >= (lane.max_concurrency or 1):
                    item.is_skipped = True
                    bar.total -= 1 + len(item.req.follow_ups)
                    bar.refresh()
                    return
                req = item.req
                for k in range(1 + len(item.req.follow_ups)):
                    if k:
                        if not item.results[-1].is_success:  # the chat ends at a failure
                            bar.total -= len(item.req.follow_ups) - k + 1
                            bar.refresh()
                            return
                        req = req.next_turn(item.results[-1].text, item.req.follow_ups[k - 1])
                    start = time.perf_counter() - t0
                    try:
                        result = await send(req)
                    except asyncio.CancelledError:
                        if k:  # a chat cut at the time limit: this turn is incomplete
                            item.results.append(_incomplete(req, max_duration_s))
                        raise
                    result.start = start
                    item.results.append(result)
                    bar.update(1)

        async def issue(lane: Lane, items: list[_Issued]) -> None:
            slots = asyncio.Semaphore(lane.max_concurrency or max(1, len(items)))
            for i, item in enumerate(items):
                if math.isfinite(lane.request_rate):  # a Poisson process: even the first
                    await asyncio.sleep(rng.exponential(1.0 / lane.request_rate))
                item.task = asyncio.create_task(one(lane, item, slots, i))
            await asyncio.gather(*(item.task for item in items if item.task))
            lane.done.set()

        issuers = [asyncio.create_task(issue(lane, items)) for lane, items in zip(
            lanes, issued, strict=True)]
        _, pending = await asyncio.wait(issuers, timeout=max_duration_s)
        if pending:
            running = [it.task for items in issued for it in items if it.task] + list(pending)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
    duration = time.perf_counter() - t0
    results = []
    for items in issued:
        for item in items:
            results += item.results
            if not item.results and not item.is_skipped:
                results.append(_incomplete(item.req, max_duration_s))
    return results, duration


def _incomplete(req: BenchRequest, max_duration_s: float) -> RequestResult:
    return RequestResult(group=req.group, is_incomplete=True, input_len=req.input_len,
                         error=f"not finished within --max-duration {max_duration_s:g} s")
