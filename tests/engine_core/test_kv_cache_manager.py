"""KVCacheManager: prefix-cache hits with exact block ids, slot allocation, idempotent free, and
a seeded random stress test that checks the pool's integrity after every operation."""

from __future__ import annotations

import random

import pytest

from engine_core.kv_cache.manager import KVCacheManager, cdiv
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_req(req_id: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens))


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """What the scheduler does after a step: the KV of the first num_tokens tokens exists."""
    req.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(req)


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


# -- randomized stress ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_pool_consistent(seed):
    """A few hundred allocate / compute / decode / free / preempt operations over prompts that
    share prefixes. After every one: the pool agrees with the manager, every request holds
    exactly the blocks its tokens need, and every prefix hit names blocks whose KV was
    written from exactly that prefix."""
    rng = random.Random(seed)
    num_blocks = 24
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    bases = [[rng.randrange(50) for _ in range(20)] for _ in range(3)]
    # what each block's KV was computed from: the token prefix ending at that block's end
    written: dict[int, tuple[int, ...]] = {}
    active: dict[str, Request] = {}
    num_allocated: dict[str, int] = {}  # tokens the request has slots for
    num_hits = 0
    num_no_room = 0
    next_id = 0

    def write(req: Request, new_computed: int) -> None:
        """Record the KV written while computing tokens [num_computed, new_computed)."""
        blocks = kv.block_ids(req.req_id)
        first = req.num_computed_tokens // BLOCK_SIZE
        last = (new_computed - 1) // BLOCK_SIZE
        for i in range(first, last + 1):
            b = blocks[i]
            assert kv.pool.ref_cnt[b] == 1, f"writing into shared block {b}"
            end = min((i + 1) * BLOCK_SIZE, new_computed)
            written[b] = tuple(req.all_token_ids[:end])
        compute(kv, req, new_computed)

    def admit(req: Request) -> bool:
        nonlocal num_hits, num_no_room
        hit, num_hit = kv.get_computed_blocks(req)
        assert num_hit == len(hit) * BLOCK_SIZE < req.num_tokens
        for i, b in enumerate(hit):
            assert written[b] == tuple(req.all_token_ids[: (i + 1) * BLOCK_SIZE]), (
                f"block {b} hit for {req.req_id} holds other tokens"
            )
        n = rng.randint(1, req.num_tokens - num_hit)
        if kv.allocate_slots(req, num_hit + n, hit) is None:
            num_no_room += 1
            kv.free(req.req_id)  # dropped, as an abort of a waiting request would
            return False
        num_hits += len(hit)
        req.num_computed_tokens = num_hit
        active[req.req_id] = req
        num_allocated[req.req_id] = num_hit + n
        write(req, num_hit + n)
        return True

    def release(req_id: str) -> None:
        kv.free(req_id)
        del active[req_id]
        del num_allocated[req_id]

    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not active:
            base = rng.choice(bases)
            prompt = base[: rng.randint(1, len(base))] + [
                rng.randrange(50) for _ in range(rng.randint(0, 6))
            ]
            admit(make_req(f"r{next_id}", prompt))
            next_id += 1
        elif op < 0.75:
            req = active[rng.choice(sorted(active))]
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(rng.randrange(50))  # a decode step's sampled token
            n = rng.randint(1, req.num_tokens - req.num_computed_tokens)
            if kv.allocate_slots(req, req.num_computed_tokens + n) is None:
                num_no_room += 1
                # preempted: start over later from the prefix cache
                release(req.req_id)
                req.num_computed_tokens = 0
                admit(req)
            else:
                num_allocated[req.req_id] = req.num_computed_tokens + n
                write(req, req.num_computed_tokens + n)
        else:
            req_id = rng.choice(sorted(active))
            release(req_id)
            kv.free(req_id)  # a second free changes nothing

        kv.check_integrity()
        for req_id, req in active.items():
            assert len(kv.block_ids(req_id)) == cdiv(num_allocated[req_id], BLOCK_SIZE)
            assert req.num_computed_tokens == num_allocated[req_id]
        assert kv.num_free_blocks == num_blocks - len({b for r in active for b in kv.block_ids(r)})

    # both paths the test exists for were taken
    assert num_hits > 0, "the random prompts never shared a prefix"
    assert num_no_room > 0, "the pool never ran out"
    for req_id in list(active):
        release(req_id)
    kv.check_integrity()
    assert kv.num_free_blocks == num_blocks
    assert kv.usage == 0.0
    assert kv.req_blocks == {} and kv.req_hashes == {} and kv.req_num_published == {}
