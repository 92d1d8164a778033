"""Forks (the n samples of one prompt) on the pure scheduler: the prompt is computed once, the
children share its blocks by reference, the last block is copied on write, and every block
comes back to the pool on every path. Block size 4 (scheduler_sim)."""

from __future__ import annotations

from engine_core.request import RequestStatus
from tests.engine_core.scheduler_sim import (
    assert_pool_full,
    make_req,
    make_scheduler,
    run_to_completion,
    step,
)


def add_samples(sched, n: int, num_prompt_tokens: int, **params) -> list:
    reqs = [make_req(f"r{i}", num_prompt_tokens, **params) for i in range(n)]
    sched.add_request(reqs[0])
    for r in reqs[1:]:
        sched.add_request(r, fork_of="r0")
    return reqs


def test_children_share_the_prompt_blocks_and_copy_the_partial_one_on_write():
    sched = make_scheduler(num_blocks=16)
    parent, c1, c2 = add_samples(sched, 3, 10)  # blocks [0 1 2], block 2 holds 2 tokens
    assert c1.status == c2.status == RequestStatus.WAITING_FOR_PARENT
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r0"] and out.num_scheduled_tokens == [10]
    assert sched.num_forks == 2
    blocks = sched.kv.block_ids("r0")
    assert blocks == [0, 1, 2]
    assert sched.kv.block_ids("r1") == sched.kv.block_ids("r2") == blocks
    assert [sched.kv.pool.ref_cnt[b] for b in blocks] == [3, 3, 3]
    assert c1.num_computed_tokens == c2.num_computed_tokens == 9
    assert sched.kv.num_free_blocks == 13

    out, _ = step(sched)
    # the parent decodes position 10, each child recomputes position 9 only: all three write
    # into block 2; the first two copy it (into 3 and 4), the last holder writes in place
    assert [r.req_id for r in out.reqs] == ["r0", "r1", "r2"]
    assert out.num_scheduled_tokens == [1, 1, 1]
    assert out.blocks_to_copy == [(2, 3), (2, 4)]
    assert out.rewritten_req_ids == {"r0", "r1"}
    assert sched.kv.block_ids("r0") == [0, 1, 3]
    assert sched.kv.block_ids("r1") == [0, 1, 4]
    assert sched.kv.block_ids("r2") == [0, 1, 2]
    assert [sched.kv.pool.ref_cnt[b] for b in range(5)] == [3, 3, 1, 1, 1]
    assert c1.num_output_tokens == c2.num_output_tokens == 1  # each sampled its own first
    assert c1.num_cached_tokens == 9

    run_to_completion(sched)
    assert_pool_full(sched)


def test_a_block_aligned_prompt_copies_its_published_last_block():
    """A child rewrites the prompt's last token, in a full block the cache has published:
    published blocks are immutable, so even its last holder copies it."""
    sched = make_scheduler(num_blocks=16)
    parent, c1 = add_samples(sched, 2, 8, max_tokens=1)  # the parent ends at its first token
    step(sched)
    assert parent.is_finished and c1.num_computed_tokens == 7
    assert sched.kv.block_ids("r1") == [0, 1]
    assert sched.kv.pool.ref_cnt[1] == 1 and sched.kv.pool.block_hash[1] is not None
    out, _ = step(sched)
    assert out.blocks_to_copy == [(1, 2)] and out.rewritten_req_ids == {"r1"}
    assert c1.is_finished  # max_tokens 1: its blocks are back already
    assert_pool_full(sched)


def test_a_fork_of_a_running_parent_forks_at_once():
    sched = make_scheduler(num_blocks=16)
    parent = make_req("r0", 6, max_tokens=8)
    sched.add_request(parent)
    step(sched)
    sched.add_request(make_req("r1", 6), fork_of="r0")
    assert sched.requests["r1"].num_computed_tokens == 5 and sched.num_forks == 1
    run_to_completion(sched)
    assert_pool_full(sched)


def test_children_of_a_parent_aborted_before_its_prefill_run_as_plain_requests():
    sched = make_scheduler(num_blocks=16)
    add_samples(sched, 3, 10)
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in sched.waiting] == ["r1", "r2"]
    assert all(r.num_computed_tokens == 0 for r in sched.waiting)
    out, _ = step(sched)
    assert out.num_scheduled_tokens[0] == 10 and sched.num_forks == 0
    run_to_completion(sched)
    assert_pool_full(sched)


def test_every_abort_path_returns_every_block():
    # a pending child aborted, then a forked child before its first step, then the parent
    # mid-decode, then the rest
    sched = make_scheduler(num_blocks=16)
    add_samples(sched, 4, 10, max_tokens=20)
    sched.finish_requests(["r3"], RequestStatus.FINISHED_ABORTED)
    assert sched.children["r0"] == [sched.requests["r1"], sched.requests["r2"]]
    step(sched)
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    step(sched)
    step(sched)
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    step(sched)
    sched.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    assert_pool_full(sched)


def test_a_preempted_child_recomputes_and_frees_everything():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    add_samples(sched, 3, 10, max_tokens=12, ignore_eos=True)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert_pool_full(sched)


def test_a_child_asking_for_prompt_logprobs_is_not_forked():
    sched = make_scheduler()
    sched.add_request(make_req("r0", 10))
    sched.add_request(make_req("r1", 10, prompt_logprobs=0), fork_of="r0")
    sched.add_request(make_req("r2", 11), fork_of="r0")  # another prompt
    assert [r.req_id for r in sched.waiting] == ["r0", "r1", "r2"]
    run_to_completion(sched)
    assert sched.num_forks == 0
    assert_pool_full(sched)


def test_forks_that_fill_the_pool_give_their_blocks_back_instead_of_waiting_forever():
    """A 15-token prompt fills the 4-block pool; its parent ends at its first token and two
    children hold every block, sharing the partial last one: neither can copy it. One gives
    its blocks back, the other writes in place, then the first runs on its own."""
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    add_samples(sched, 3, 15, max_tokens=1)
    step(sched)
    assert sched.kv.num_free_blocks == 0 and sched.num_forks == 2
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r2"] and out.blocks_to_copy == []
    out, _ = step(sched)
    assert [r.req_id for r in out.reqs] == ["r1"] and out.num_scheduled_tokens == [3]
    assert_pool_full(sched)
