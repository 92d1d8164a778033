"""Scheduler as a pure state machine: token-id prompts, made-up sampled tokens, no model.

Each simulated step is `schedule()` then `update_from_output(out, sampled)`, with the KV cache
checked for integrity after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine_core.config import SchedulerConfig
from engine_core.kv_cache.manager import KVCacheManager, cdiv
from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4
EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    return Scheduler(config, kv, max_model_len)


def make_req(req_id: str, num_prompt_tokens: int, first_token: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 4)
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Request(req_id, prompt, SamplingParams(**params), eos_token_ids=(EOS,))


def next_token(req: Request) -> int:
    """A made-up token that names its request and position: catches misplaced tokens."""
    return 1000 * (1 + int(req.req_id.lstrip("r"))) + req.num_output_tokens


def step(
    sched: Scheduler, token_for: Callable[[Request], int] = next_token
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step. Like the model runner, only requests that catch up sample a token."""
    out = sched.schedule()
    check_output(sched, out)
    sampled = [
        [token_for(r)] if r.num_computed_tokens + n == r.num_tokens else []
        for r, n in zip(out.reqs, out.num_scheduled_tokens, strict=True)
    ]
    advanced = sched.update_from_output(out, sampled)
    sched.kv.check_integrity()
    return out, advanced


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of every schedule() result."""
    assert out.total_num_tokens <= sched.config.max_num_batched_tokens
    assert len(out.reqs) <= sched.config.max_num_seqs
    assert sched.num_running <= sched.config.max_num_seqs
    assert len({r.req_id for r in out.reqs}) == len(out.reqs)
    assert out.num_scheduled_tokens[: out.num_decodes] == [1] * out.num_decodes
    for i, (r, n) in enumerate(zip(out.reqs, out.num_scheduled_tokens, strict=True)):
        # decodes lead; a decode is one token after the prompt (a prompt's last token is not)
        past_prompt = r.num_computed_tokens >= r.num_prompt_tokens
        assert (i < out.num_decodes) == (n == 1 + r.num_lookahead_tokens and past_prompt)
        assert r.status == RequestStatus.RUNNING
        assert 1 <= n <= r.num_tokens - r.num_computed_tokens
        # the request holds the slots for everything it computes this step
        assert len(sched.kv.block_ids(r.req_id)) >= cdiv(r.num_computed_tokens + n, BLOCK_SIZE)
    assert set(out.preempted_req_ids).isdisjoint(r.req_id for r in out.reqs)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        outs.append(step(sched)[0])
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_pool_full(sched: Scheduler) -> None:
    sched.kv.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert sched.kv.req_blocks == {}


# -- admission ----------------------------------------------------------------------------


def test_add_request_rejects_prompt_plus_max_tokens_over_max_model_len():
    sched = make_scheduler(max_model_len=64)
    sched.add_request(make_req("r0", 60, max_tokens=4))  # exactly max_model_len: fine
    with pytest.raises(ValueError, match=r"60 tokens.*max_tokens \(5\).*max_model_len \(64\)"):
        sched.add_request(make_req("r1", 60, max_tokens=5))
    assert list(sched.requests) == ["r0"]
    assert sched.num_waiting == 1


def test_add_request_rejects_a_duplicate_req_id():
    sched = make_scheduler()
    sched.add_request(make_req("r0", 8))
    with pytest.raises(ValueError, match="'r0'"):
        sched.add_request(make_req("r0", 5))
    assert sched.num_waiting == 1
    assert sched.requests["r0"].num_prompt_tokens == 8


def test_a_finished_req_id_can_be_reused():
    sched = make_scheduler()
    sched.add_request(make_req("r0", 8, max_tokens=1))
    step(sched)
    assert not sched.has_unfinished()
    sched.add_request(make_req("r0", 8, max_tokens=1))
    assert sched.has_unfinished()


def test_empty_scheduler_schedules_nothing():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty
    assert out.total_num_tokens == 0
    assert sched.update_from_output(out, []) == []


# -- token budget, chunked prefill, ordering ----------------------------------------------------


def test_chunked_prefill_appends_the_sampled_token_only_at_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=32)
    req = make_req("r0", 100, max_tokens=3)
    sched.add_request(req)
    for i, (chunk, computed) in enumerate([(32, 32), (32, 64), (32, 96), (4, 100)]):
        out = sched.schedule()
        assert out.reqs == [req]
        assert out.num_scheduled_tokens == [chunk]
        assert out.num_decodes == 0
        # like the runner, only the chunk that completes the prompt samples
        advanced = sched.update_from_output(out, [[500 + i]] if computed == 100 else [[]])
        assert req.num_computed_tokens == computed
        sched.kv.check_integrity()
        if computed < 100:
            assert advanced == []
            assert req.output_token_ids == []
    assert advanced == [req]
    assert req.output_token_ids == [503]  # only the last chunk's token
    assert req.num_tokens == 101

    out, _ = step(sched)  # now a decode
    assert out.num_scheduled_tokens == [1]
    assert out.num_decodes == 1


def test_token_budget_is_shared_and_filled():
    sched = make_scheduler(max_num_batched_tokens=32)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", 20, first_token=100 * i, max_tokens=8))
    reqs = [sched.requests[f"r{i}"] for i in range(3)]

    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r0", "r1"]
    assert out.num_scheduled_tokens == [20, 12]  # r1 gets the rest as a chunk
    assert sched.num_waiting == 1  # r2 waits: no budget left

    out, _ = step(sched)
    # r0 decodes, r1 finishes its prefill, r2 is admitted with what is left
    assert [r.req_id for r in out.reqs] == ["r0", "r1", "r2"]
    assert out.num_scheduled_tokens == [1, 8, 20]
    assert out.num_decodes == 1
    assert [r.num_output_tokens for r in reqs] == [2, 1, 1]


def test_decodes_come_first():
    """Decodes lead the step, before prefill chunks. A 1-token chunk of a prompt is no decode:
    it takes the prefill path, as it would in a longer chunk (the decode path rounds
    differently, and a prompt's KV must not depend on how it was chunked or cached)."""
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_req("r0", 31, max_tokens=4))
    sched.add_request(make_req("r1", 5, first_token=300, max_tokens=4))
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r0"]
    assert out.num_scheduled_tokens == [16]

    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r0", "r1"]
    assert out.num_scheduled_tokens == [15, 1]  # r1's first prompt token
    assert out.num_decodes == 0

    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r0", "r1"]
    assert out.num_scheduled_tokens == [1, 4]
    assert out.num_decodes == 1

    out, _ = step(sched)
    assert out.num_scheduled_tokens == [1, 1]
    assert out.num_decodes == 2


def test_many_requests_respect_the_budget_every_step():
    sched = make_scheduler(max_num_batched_tokens=24, max_num_seqs=4, num_blocks=200)
    for i in range(10):
        sched.add_request(make_req(f"r{i}", 3 + 7 * i, first_token=50 * i, max_tokens=5))
    reqs = list(sched.requests.values())
    outs = run_to_completion(sched)
    assert all(o.total_num_tokens <= 24 for o in outs)
    assert max(o.total_num_tokens for o in outs) == 24
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [next_token(r) - r.num_output_tokens + k for k in range(5)]
    assert_pool_full(sched)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 4, first_token=10 * i, max_tokens=2))
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 3)
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r0", "r1"]  # both finish here (max_tokens=2)
    assert (sched.num_running, sched.num_waiting) == (0, 3)
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r2", "r3"]
    assert out.finished_req_ids == ["r0", "r1"]
    run_to_completion(sched)
    assert_pool_full(sched)


# -- finishing ------------------------------------------------------------------------------


def test_max_tokens_finishes_with_length_and_frees_blocks():
    sched = make_scheduler()
    req = make_req("r0", 10, max_tokens=3)
    sched.add_request(req)
    for k in range(3):
        out, advanced = step(sched)
        assert advanced == [req]
        assert req.num_output_tokens == k + 1
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.is_finished
    assert req.output_token_ids == [1000, 1001, 1002]
    assert not sched.has_unfinished()
    assert sched.num_running == 0
    assert_pool_full(sched)
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_req_ids == ["r0"]
    assert sched.schedule().finished_req_ids == []  # reported once


def test_eos_finishes_with_stopped():
    sched = make_scheduler()
    req = make_req("r0", 6, max_tokens=10)
    sched.add_request(req)
    tokens = iter([7, 8, EOS, 9])
    while sched.has_unfinished():
        step(sched, lambda r: next(tokens))
    assert req.output_token_ids == [7, 8, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert_pool_full(sched)


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    req = make_req("r0", 6, max_tokens=5, ignore_eos=True)
    sched.add_request(req)
    for _ in range(4):
        step(sched, lambda r: EOS)
        assert req.status == RequestStatus.RUNNING
    step(sched, lambda r: EOS)
    assert req.output_token_ids == [EOS] * 5
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert_pool_full(sched)


def test_ignore_eos_still_honours_stop_token_ids():
    sched = make_scheduler()
    req = make_req("r0", 6, max_tokens=5, ignore_eos=True, stop_token_ids=[77])
    sched.add_request(req)
    tokens = iter([EOS, 77])
    while sched.has_unfinished():
        step(sched, lambda r: next(tokens))
    assert req.output_token_ids == [EOS, 77]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_min_tokens_delays_eos():
    """EOS ends the request only once min_tokens tokens exist (vLLM's check_stop)."""
    sched = make_scheduler()
    req = make_req("r0", 6, max_tokens=10, min_tokens=3)
    sched.add_request(req)
    for k in range(1, 3):
        step(sched, lambda r: EOS)
        assert req.num_output_tokens == k
        assert req.status == RequestStatus.RUNNING
    step(sched, lambda r: EOS)
    assert req.output_token_ids == [EOS] * 3
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert_pool_full(sched)


def test_max_tokens_wins_over_a_late_eos():
    sched = make_scheduler()
    req = make_req("r0", 6, max_tokens=2, min_tokens=2)
    sched.add_request(req)
    step(sched, lambda r: EOS)
    step(sched, lambda r: 9)
    assert req.status == RequestStatus.FINISHED_LENGTH


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
