"""A decode worker's local prefill in the scheduler: a reserved request computes its own
prompt, chunked, after the running decodes, in the blocks its reservation holds."""

from __future__ import annotations

import pytest

from engine_core.request import RequestStatus
from tests.engine_core.scheduler_sim import make_req, make_scheduler, step


def _decoding(sched, req_id: str, num_prompt_tokens: int):
    """A request already decoding (prefilled in one step)."""
    sched.add_request(make_req(req_id, num_prompt_tokens, max_tokens=50))
    step(sched)
    assert sched.requests[req_id].num_output_tokens == 1


def test_local_prefill_chunks_after_the_running_decodes_in_its_reserved_blocks():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=16)
    _decoding(sched, "r0", 6)
    _decoding(sched, "r1", 6)
    req = make_req("r2", 30, first_token=300)
    blocks = sched.reserve(req)
    sched.prefill_reserved("r2", max_chunk_tokens=8)
    assert req.status == RequestStatus.RUNNING and "r2" not in sched.reserved
    chunks = []
    while req.num_output_tokens == 0:
        out, _ = step(sched)
        # both decodes run in every step: the prefill never takes their budget
        assert [r.req_id for r in out.reqs[:out.num_decodes]] == ["r0", "r1"]
        chunks.append(dict(zip((r.req_id for r in out.reqs), out.num_scheduled_tokens,
                               strict=True))["r2"])
    assert chunks == [8, 8, 8, 6]
    # the prompt was computed in the blocks reserved for it: it took no other block
    assert sched.kv.block_ids("r2") == blocks


def test_local_prefills_share_one_cap_per_step():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    _decoding(sched, "r0", 6)
    for req_id, first in (("r1", 300), ("r2", 400)):
        sched.reserve(make_req(req_id, 12, first_token=first))
        sched.prefill_reserved(req_id, max_chunk_tokens=8)
    steps = []
    while any(sched.requests[r].num_output_tokens == 0 for r in ("r1", "r2")):
        out, _ = step(sched)
        got = dict(zip((r.req_id for r in out.reqs), out.num_scheduled_tokens, strict=True))
        assert got["r0"] == 1  # the decode runs every step
        steps.append((got.get("r1", 0), got.get("r2", 0)))
    # 8 prompt tokens per step in all: r1 first, r2 takes what r1 leaves (then r1 decodes)
    assert steps == [(8, 0), (4, 4), (1, 8)]


def test_local_prefill_starts_after_the_cached_prefix():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_req("r0", 17, max_tokens=1))
    step(sched)  # r0 finished: its 4 full blocks (16 tokens) stay cached
    req = make_req("r1", 25)  # the same first 17 tokens, then 8 more
    sched.reserve(req)
    assert req.num_cached_tokens == 16
    sched.prefill_reserved("r1", max_chunk_tokens=64)
    out, advanced = step(sched)
    assert out.num_scheduled_tokens == [9] and advanced == [req]


def test_a_fully_cached_prompt_still_computes_its_last_block():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_req("r0", 16, max_tokens=1))
    step(sched)
    req = make_req("r1", 16)
    sched.reserve(req)
    sched.prefill_reserved("r1", max_chunk_tokens=64)
    out, advanced = step(sched)
    # whole blocks hit and the last token's logits give the first token: 12 of 16 cached
    assert req.num_cached_tokens == 12
    assert out.num_scheduled_tokens == [4] and out.num_decodes == 0 and advanced == [req]


def test_aborting_a_local_prefill_frees_its_blocks():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    free = sched.kv.num_free_blocks
    sched.reserve(make_req("r0", 30))
    sched.prefill_reserved("r0", max_chunk_tokens=4)
    step(sched)
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == free and not sched.has_unfinished()
    sched.kv.check_integrity()


def test_prefill_reserved_rejects_a_chunk_below_one_and_an_unknown_request():
    sched = make_scheduler()
    sched.reserve(make_req("r0", 8))
    with pytest.raises(ValueError, match="max_chunk_tokens must be >= 1, got 0"):
        sched.prefill_reserved("r0", max_chunk_tokens=0)
    with pytest.raises(KeyError):
        sched.prefill_reserved("nope", max_chunk_tokens=4)
