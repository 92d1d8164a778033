"""Scheduler as a pure state machine (tests/engine_core/scheduler_sim.py): preemption, aborts,
the prefix cache, and a randomized workload checked against every invariant.
"""

from __future__ import annotations

import random

import pytest

from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from tests.engine_core.scheduler_sim import (
    EOS,
    assert_pool_full,
    make_req,
    make_scheduler,
    run_to_completion,
    step,
)

# -- preemption -----------------------------------------------------------------------------


def test_preemption_takes_the_newest_running_request_and_everything_finishes():
    # 6 blocks of 4 tokens; each request grows to 6 + 10 = 16 tokens = 4 blocks
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", 6, first_token=100 * (i + 1), max_tokens=10))
    reqs = [sched.requests[f"r{i}"] for i in range(3)]

    first_preemption = None
    outs = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        running_before = [r.req_id for r in sched.running]
        out, _ = step(sched)
        outs.append(out)
        if out.preempted_req_ids and first_preemption is None:
            first_preemption = (running_before, out, list(sched.waiting))
    else:
        raise AssertionError("did not finish")

    assert first_preemption is not None, "the pool never ran out: the test lost its point"
    running_before, out, waiting_after = first_preemption
    victim_id = out.preempted_req_ids[0]
    assert victim_id == running_before[-1]  # the most recently admitted
    victim = next(r for r in reqs if r.req_id == victim_id)
    assert waiting_after[0] is victim  # back at the front of the queue
    assert victim.num_preemptions >= 1
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    assert sched.num_preemptions == sum(len(o.preempted_req_ids) for o in outs)

    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        base = 1000 * (1 + int(r.req_id[1:]))
        assert r.output_token_ids == [base + k for k in range(10)]
        assert r.all_token_ids == r.prompt_token_ids + r.output_token_ids
    assert_pool_full(sched)


def test_preempted_request_state():
    """Right after preemption: blocks freed, num_computed_tokens 0, status PREEMPTED, first in
    the waiting queue; output tokens kept (they are recomputed, not regenerated)."""
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = make_req("r0", 4, first_token=100, max_tokens=8)
    b = make_req("r1", 4, first_token=200, max_tokens=8)
    c = make_req("r2", 4, first_token=300, max_tokens=8)
    d = make_req("r3", 8, first_token=400, max_tokens=8)
    for r in (a, b, c, d):
        sched.add_request(r)
    step(sched)  # a, b, c admitted: 4 tokens + 1 output each -> 1 block each (3 of 4 used)
    assert [r.num_tokens for r in (a, b, c)] == [5, 5, 5]
    assert sched.kv.num_free_blocks == 1
    assert list(sched.waiting) == [d]  # needs 2 blocks
    # a needs a second block (takes the last free one); b needs one too -> c is preempted
    out, _ = step(sched)
    assert out.preempted_req_ids == ["r2"]
    assert [r.req_id for r in out.reqs] == ["r0", "r1"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.output_token_ids == [3000]
    assert sched.kv.block_ids("r2") == []
    assert list(sched.waiting) == [c, d]  # ahead of requests that never ran
    assert sched.running == [a, b]
    run_to_completion(sched)
    assert [r.num_output_tokens for r in (a, b, c, d)] == [8, 8, 8, 8]
    assert_pool_full(sched)


def test_a_request_can_preempt_itself():
    """When the only way to make room would be to preempt requests ahead of it, the request
    preempts itself (it is the newest) and earlier requests keep running."""
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = make_req("r0", 4, first_token=100, max_tokens=6)
    b = make_req("r1", 7, first_token=200, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 1 block, b: 2 blocks
    assert sched.kv.num_free_blocks == 0
    out, _ = step(sched)  # a needs a 2nd block: b is preempted, a proceeds
    assert out.preempted_req_ids == ["r1"]
    assert out.reqs == [a]
    run_to_completion(sched)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [1000 + k for k in range(6)]
    assert b.output_token_ids == [2000 + k for k in range(6)]
    assert_pool_full(sched)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_heavy_preemption_all_requests_finish(enable_prefix_caching):
    sched = make_scheduler(
        num_blocks=10,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        enable_prefix_caching=enable_prefix_caching,
    )
    for i in range(8):
        # shared first block for half of them, so prefix hits and preemption interact
        first = 100 if i % 2 == 0 else 100 * (i + 1)
        sched.add_request(make_req(f"r{i}", 5 + i, first_token=first, max_tokens=7 + i % 3))
    reqs = list(sched.requests.values())
    outs = run_to_completion(sched)
    assert sum(len(o.preempted_req_ids) for o in outs) > 0
    for r in reqs:
        n = r.sampling_params.max_tokens
        assert r.status == RequestStatus.FINISHED_LENGTH
        base = 1000 * (1 + int(r.req_id[1:]))
        assert r.output_token_ids == [base + k for k in range(n)]
    assert_pool_full(sched)


# -- aborts ---------------------------------------------------------------------------------


def test_finish_requests_aborts_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    a = make_req("r0", 9, max_tokens=8)
    b = make_req("r1", 9, first_token=200, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert sched.kv.block_ids("r0") != []

    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0
    sched.finish_requests(["r0", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.num_running == 0
    assert not sched.has_unfinished()
    assert_pool_full(sched)

    # finishing again changes nothing
    sched.finish_requests(["r0"], RequestStatus.FINISHED_STOPPED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_req_ids == ["r1", "r0"]


def test_finish_requests_aborts_a_preempted_request():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    reqs = [make_req(f"r{i}", 4, first_token=100 * (i + 1), max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_req_ids == ["r2"]
    sched.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)
    assert reqs[2].status == RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0
    run_to_completion(sched)
    assert_pool_full(sched)


def test_abort_mid_prefill_frees_blocks():
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_req("r0", 30)
    sched.add_request(req)
    step(sched)
    step(sched)
    assert req.num_computed_tokens == 16
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert_pool_full(sched)


# -- prefix cache -----------------------------------------------------------------------------


def test_prefix_cache_hit_sets_num_cached_tokens():
    sched = make_scheduler()
    a = make_req("r0", 18, max_tokens=4)
    sched.add_request(a)
    step(sched)
    assert a.num_cached_tokens == 0
    b = make_req("r1", 18, max_tokens=4)  # same prompt
    sched.add_request(b)
    out, _ = step(sched)
    assert b.num_cached_tokens == 16  # 4 full blocks of a's prompt, last token recomputed
    assert out.reqs == [a, b]
    assert out.num_scheduled_tokens == [1, 2]
    assert sched.kv.block_ids("r1")[:4] == sched.kv.block_ids("r0")[:4]
    run_to_completion(sched)
    assert_pool_full(sched)


def test_prefix_cache_hit_after_the_first_request_finished():
    sched = make_scheduler()
    a = make_req("r0", 13, max_tokens=1)
    sched.add_request(a)
    step(sched)
    assert a.is_finished
    b = make_req("r1", 13, max_tokens=1)
    sched.add_request(b)
    out, _ = step(sched)
    assert b.num_cached_tokens == 12
    assert out.num_scheduled_tokens == [1]
    assert b.output_token_ids == [2000]
    assert_pool_full(sched)


def test_no_prefix_hit_when_caching_is_disabled():
    sched = make_scheduler(enable_prefix_caching=False)
    sched.add_request(make_req("r0", 18))
    step(sched)
    b = make_req("r1", 18)
    sched.add_request(b)
    out, _ = step(sched)
    assert b.num_cached_tokens == 0
    assert out.num_scheduled_tokens == [1, 18]


def test_num_cached_tokens_is_set_once_not_after_preemption():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=True)
    a = make_req("r0", 4, first_token=100, max_tokens=8)
    b = make_req("r1", 4, first_token=200, max_tokens=8)
    c = make_req("r2", 4, first_token=100, max_tokens=8)  # a's prompt
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)  # c is admitted with a, before a's block is computed: no hit
    assert c.num_cached_tokens == 0
    out, _ = step(sched)
    assert out.preempted_req_ids == ["r2"]
    num_hits_before = sched.kv.pool.num_cache_hits
    run_to_completion(sched)
    # c's readmission hits a's block, but that recomputes c's own work: not a cache hit of
    # its prompt as the client sees it
    assert sched.kv.pool.num_cache_hits > num_hits_before
    assert c.num_cached_tokens == 0
    assert c.status == RequestStatus.FINISHED_LENGTH
    assert_pool_full(sched)


# -- randomized stress ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_workload_keeps_every_invariant(seed):
    """Arrivals, EOS, aborts and preemption on a tiny pool. Every step keeps the invariants of
    check_output and the pool's integrity; every request ends with the tokens it was given,
    and the pool ends full."""
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=12, max_num_batched_tokens=20, max_num_seqs=4, max_model_len=48
    )
    bases = [[rng.randrange(3, 40) for _ in range(24)] for _ in range(2)]
    reqs: list[Request] = []
    given: dict[str, list[int]] = {}  # the tokens handed to each request, in order
    aborted: set[str] = set()
    num_preempted = 0

    def token_for(r: Request) -> int:
        t = EOS if rng.random() < 0.08 else rng.randrange(3, 40)
        given[r.req_id].append(t)
        return t

    for step_idx in range(300):
        if step_idx < 200 and rng.random() < 0.3:
            i = len(reqs)
            prompt = rng.choice(bases)[: rng.randint(1, 24)] + [rng.randrange(3, 40)]
            max_tokens = rng.randint(1, 20)
            req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), (EOS,))
            sched.add_request(req)
            reqs.append(req)
            given[req.req_id] = []
        if sched.requests and rng.random() < 0.03:
            req_id = rng.choice(sorted(sched.requests))
            sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            aborted.add(req_id)
            sched.kv.check_integrity()
        out, _ = step(sched, token_for)
        num_preempted += len(out.preempted_req_ids)
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
            assert sched.kv.block_ids(r.req_id) == []
        if step_idx >= 200 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert num_preempted > 0, "the pool never ran out: the test lost its point"

    for r in reqs:
        assert r.is_finished
        assert r.output_token_ids == given[r.req_id]
        assert r.all_token_ids == r.prompt_token_ids + r.output_token_ids
        if r.req_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
        elif r.output_token_ids and r.output_token_ids[-1] == EOS:
            assert r.status == RequestStatus.FINISHED_STOPPED
            assert EOS not in r.output_token_ids[:-1]
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.num_output_tokens == r.sampling_params.max_tokens
            assert EOS not in r.output_token_ids
    assert_pool_full(sched)


def test_a_request_holding_blocks_behind_one_that_cannot_fit_goes_first():
    """Nothing runs; the head of the queue cannot get its blocks because the request behind
    it holds them (loaded from the offload tiers, or a fork, then passed by a preempted
    request): the holder goes first, instead of the pool waiting for itself forever."""
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    holder = make_req("r1", 12, first_token=100, max_tokens=4)
    sched.add_request(holder)
    assert sched.kv.allocate_slots(holder, 12, []) is not None  # its 3 blocks, as a load
    holder.num_computed_tokens = 8  # leaves them computed
    head = make_req("r2", 14, first_token=300, max_tokens=4)  # 4 blocks: 3 are left
    sched.add_request(head)
    sched.waiting.remove(head)
    sched.waiting.appendleft(head)
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r1"]  # runs on its own blocks
    run_to_completion(sched)
    assert head.status == holder.status == RequestStatus.FINISHED_LENGTH
    assert_pool_full(sched)


class _Tiers:
    """Offload tiers that hold `held` blocks of any prompt; counts lookups and loads."""

    def __init__(self, held: int) -> None:
        self.held, self.lookups, self.loads = held, 0, []

    def lookup(self, hashes: list[int]) -> int:
        self.lookups += 1
        return min(self.held, len(hashes))

    def load(self, req_id: str, block_ids: list[int], hashes: list[int]) -> None:
        self.loads.append((req_id, len(block_ids)))

    def swap_out(self, blocks: list[tuple[int, int]]) -> None:
        raise AssertionError("nothing is preempted here")


def test_a_tier_hit_without_room_is_not_looked_up_again_each_step():
    """The tiers hold a waiting request's 5 blocks, the pool has 3 free while another runs:
    it waits, and the tiers (a Redis round trip each) are asked once, not every step; once
    the pool frees, it loads those 5 blocks and runs on them."""
    sched = make_scheduler(num_blocks=8)
    sched.tiers.offload = tiers = _Tiers(held=5)
    running = make_req("r1", 20, first_token=100, max_tokens=8)
    sched.add_request(running)
    running.tiers_checked = True  # admitted as if the tiers had nothing for it
    step(sched)
    back = make_req("r2", 21, first_token=500, max_tokens=2)
    sched.add_request(back)
    for _ in range(5):
        step(sched)
        assert back.status == RequestStatus.WAITING
    assert tiers.lookups == 1 and not tiers.loads
    while running.status == RequestStatus.RUNNING:
        step(sched)
    step(sched)  # room now: the load starts
    assert tiers.loads == [("r2", 5)] and tiers.lookups == 1
    assert back.status == RequestStatus.WAITING_FOR_OFFLOAD
    sched.finish_load("r2", 5)
    out, _ = step(sched)
    assert out.reqs == [back] and out.num_scheduled_tokens == [1]  # only its last token
    run_to_completion(sched)
    assert back.status == RequestStatus.FINISHED_LENGTH
    assert_pool_full(sched)
