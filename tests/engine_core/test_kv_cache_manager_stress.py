"""KVCacheManager under a seeded random stress test that checks the pool's integrity after
every operation."""

from __future__ import annotations

import random

import pytest

from engine_core.kv_cache.manager import KVCacheManager, cdiv
from engine_core.request import Request
from tests.engine_core.kv_cache_helpers import BLOCK_SIZE, compute, make_req


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
