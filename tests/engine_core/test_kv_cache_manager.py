"""KVCacheManager: prefix-cache hits with exact block ids, slot allocation and idempotent free
(the seeded random stress test: test_kv_cache_manager_stress.py)."""

from __future__ import annotations

import pytest

from engine_core.kv_cache.manager import KVCacheManager, cdiv
from engine_core.request import Request
from tests.engine_core.kv_cache_helpers import BLOCK_SIZE, compute, make_req


def snapshot(kv: KVCacheManager) -> tuple:
    p = kv.pool
    return (
        list(p.ref_cnt),
        list(p.block_hash),
        list(p.free_queue),
        dict(p.cached),
        {k: list(v) for k, v in kv.req_blocks.items()},
        dict(kv.req_num_published),
    )


PROMPT_A = list(range(100, 110))  # 2 full blocks + 2 tokens


def test_cdiv():
    assert [cdiv(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_no_hit_before_the_earlier_request_has_computed():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, a.num_tokens) == [0, 1, 2]
    b = make_req("b", PROMPT_A[:8] + [1, 2, 3])
    # a holds the blocks but has not computed (or published) them yet
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.check_integrity()


def test_shared_prefix_hits_the_exact_blocks_of_the_earlier_request():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    assert kv.allocate_slots(a, a.num_tokens) == [0, 1, 2]
    compute(kv, a, a.num_tokens)
    assert kv.pool.block_hash[2] is None  # the partial block is not published

    b = make_req("b", PROMPT_A[:8] + [1, 2, 3, 4, 5])
    hit, num_hit = kv.get_computed_blocks(b)
    assert (hit, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, b.num_tokens, hit) == [3, 4]
    assert kv.block_ids("b") == [0, 1, 3, 4]
    assert kv.pool.ref_cnt[:5] == [2, 2, 1, 1, 1]
    kv.check_integrity()

    # a prompt that diverges inside the second block hits only the first
    c = make_req("c", PROMPT_A[:6] + [7, 7, 7])
    assert kv.get_computed_blocks(c) == ([0], 4)
    # a prompt that diverges in the first token hits nothing
    d = make_req("d", [0] + PROMPT_A[1:])
    assert kv.get_computed_blocks(d) == ([], 0)


def test_hit_after_partial_compute_covers_only_computed_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, 7)  # a chunked prefill: block 0 full, block 1 not yet
    b = make_req("b", list(PROMPT_A))
    assert kv.get_computed_blocks(b) == ([0], 4)
    compute(kv, a, 10)
    assert kv.get_computed_blocks(b) == ([0, 1], 8)


def test_hit_survives_the_earlier_request_being_freed():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, a.num_tokens)
    kv.free("a")
    assert kv.pool.ref_cnt == [0] * 10
    b = make_req("b", list(PROMPT_A))
    assert kv.get_computed_blocks(b) == ([0, 1], 8)


@pytest.mark.parametrize(
    "prompt_len, num_hit_blocks",
    [(4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)],
)
def test_never_hits_the_whole_prompt(prompt_len, num_hit_blocks):
    """At least one token is left to compute: its logits give the first output token."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(prompt_len))
    a = make_req("a", prompt)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, a.num_tokens)
    b = make_req("b", list(prompt))
    hit, num_hit = kv.get_computed_blocks(b)
    assert hit == list(range(num_hit_blocks))
    assert num_hit == num_hit_blocks * BLOCK_SIZE
    assert num_hit < b.num_tokens


def _prompt_then_outputs(kv: KVCacheManager) -> Request:
    """A 6-token prompt computed, then 3 generated tokens (blocks [1 2 3 4][5 6 7 8][9])."""
    a = make_req("a", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(a, 6)
    compute(kv, a, 6)
    for token, total in ((7, 7), (8, 8), (9, 9)):
        a.append_output_token(token)
        kv.allocate_slots(a, total)
        compute(kv, a, total)
    assert a.all_token_ids == list(range(1, 10))
    return a


def test_blocks_filled_by_output_tokens_are_not_published_by_default():
    """The second block holds generated tokens (decode-computed KV): only the prompt's whole
    block serves a later prompt, which then computes the rest as a prefill would."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _prompt_then_outputs(kv)
    b = make_req("b", list(range(1, 10)) + [42])
    assert kv.get_computed_blocks(b) == ([0], 4)
    kv.check_integrity()


def test_hit_includes_blocks_filled_by_output_tokens_when_asked():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, cache_decoded_blocks=True)
    _prompt_then_outputs(kv)
    b = make_req("b", list(range(1, 10)) + [42])
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    kv.check_integrity()


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, a.num_tokens)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_req("b", list(PROMPT_A))) == ([], 0)
    kv.check_integrity()


def test_cache_query_counters():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    kv.get_computed_blocks(make_req("x", list(PROMPT_A)))
    assert (kv.pool.num_cache_queries, kv.pool.num_cache_hits) == (2, 0)
    compute(kv, a, a.num_tokens)
    kv.get_computed_blocks(make_req("y", PROMPT_A[:4] + [0, 0, 0, 0, 0]))
    assert (kv.pool.num_cache_queries, kv.pool.num_cache_hits) == (4, 1)


# -- allocate_slots ---------------------------------------------------------------------------


def test_allocate_slots_grows_block_by_block():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    r = make_req("r", list(range(5)))
    assert kv.allocate_slots(r, 5) == [0, 1]
    assert kv.allocate_slots(r, 8) == []
    assert kv.allocate_slots(r, 3) == []  # already has room
    assert kv.allocate_slots(r, 9) == [2]
    assert kv.allocate_slots(r, 17) == [3, 4]
    assert kv.block_ids("r") == [0, 1, 2, 3, 4]
    assert kv.block_ids("unknown") == []
    kv.check_integrity()


def test_allocate_slots_returns_none_and_changes_nothing_without_room():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    r = make_req("r", list(range(20)))
    assert kv.allocate_slots(r, 8) == [0, 1]
    before = snapshot(kv)
    assert kv.allocate_slots(r, 17) is None  # needs 5 blocks, has 2, 2 free
    assert snapshot(kv) == before
    assert kv.allocate_slots(r, 16) == [2, 3]
    kv.check_integrity()


def test_allocate_slots_counts_evictable_hits_against_the_free_blocks():
    """A hit on a cached-but-free block takes that block out of the free queue, so it competes
    with the new blocks for the same free slots."""
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    assert kv.allocate_slots(a, a.num_tokens) == [0, 1, 2]
    compute(kv, a, a.num_tokens)
    kv.free("a")
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]

    # 17 tokens = 5 blocks: 2 hits + 3 new, but only 4 blocks exist
    big = make_req("big", PROMPT_A[:8] + list(range(9)))
    hit, num_hit = kv.get_computed_blocks(big)
    assert (hit, num_hit) == ([0, 1], 8)
    before = snapshot(kv)
    assert kv.allocate_slots(big, big.num_tokens, hit) is None
    assert snapshot(kv) == before
    kv.check_integrity()

    # 16 tokens = 4 blocks: 2 hits + 2 new fits exactly; the new ones come from the LRU end
    fits = make_req("fits", PROMPT_A[:8] + list(range(8)))
    hit, num_hit = kv.get_computed_blocks(fits)
    assert (hit, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(fits, fits.num_tokens, hit) == [3, 2]
    assert kv.block_ids("fits") == [0, 1, 3, 2]
    assert kv.num_free_blocks == 0
    assert kv.usage == 1.0
    kv.check_integrity()


def test_allocate_slots_with_hits_in_use_needs_only_new_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    assert kv.allocate_slots(a, a.num_tokens) == [0, 1, 2]
    compute(kv, a, a.num_tokens)
    b = make_req("b", PROMPT_A[:8] + list(range(8)))
    hit, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens, hit) == [3, 4]
    assert kv.pool.ref_cnt == [2, 2, 1, 1, 1]
    kv.check_integrity()


def test_hit_blocks_are_not_republished_and_later_blocks_are():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, a.num_tokens)
    b = make_req("b", PROMPT_A[:8] + [1, 2, 3, 4, 5])
    hit, num_hit = kv.get_computed_blocks(b)
    kv.allocate_slots(b, b.num_tokens, hit)
    b.num_computed_tokens = num_hit
    assert kv.req_num_published["b"] == 2
    compute(kv, b, b.num_tokens)
    assert kv.pool.block_hash[3] is not None  # b's third block, now full and computed
    assert kv.pool.block_hash[4] is None
    c = make_req("c", PROMPT_A[:8] + [1, 2, 3, 4, 5, 6])
    assert kv.get_computed_blocks(c) == ([0, 1, 3], 12)
    kv.check_integrity()


# -- free -------------------------------------------------------------------------------------


def test_free_is_idempotent():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, a.num_tokens)
    kv.free("a")
    after_first = snapshot(kv)
    kv.free("a")
    kv.free("never-seen")
    assert snapshot(kv) == after_first
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_free_drops_only_this_requests_reference():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, a.num_tokens)
    b = make_req("b", list(PROMPT_A))
    hit, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens, hit) == [3]
    kv.free("a")
    assert kv.pool.ref_cnt[:4] == [1, 1, 0, 1]
    assert list(kv.pool.free_queue)[-1] == 2
    kv.check_integrity()
    kv.free("b")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_a_freed_request_id_can_start_over():
    """After preemption the same req_id is allocated again from scratch."""
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req("a", PROMPT_A)
    kv.allocate_slots(a, a.num_tokens)
    compute(kv, a, 5)
    kv.free("a")
    a.num_computed_tokens = 0
    hit, num_hit = kv.get_computed_blocks(a)
    assert (hit, num_hit) == ([0], 4)
    assert kv.allocate_slots(a, a.num_tokens, hit) == [3, 4]
    assert kv.block_ids("a") == [0, 3, 4]
    compute(kv, a, a.num_tokens)
    assert kv.pool.block_hash[3] is not None
    kv.check_integrity()
