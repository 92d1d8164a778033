"""Scheduler as a pure state machine (tests/engine_core/scheduler_sim.py): admission, the
token budget and chunked prefill, finishing. Preemption, aborts, the prefix cache and a
randomized workload are in test_scheduler_preemption.py.
"""

from __future__ import annotations

import pytest

from engine_core.request import RequestStatus
from tests.engine_core.scheduler_sim import (
    EOS,
    assert_pool_full,
    make_req,
    make_scheduler,
    next_token,
    run_to_completion,
    step,
)

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
