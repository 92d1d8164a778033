"""BlockPool with exact block ids: allocation order, LRU free order, ref counts, prefix cache."""

from __future__ import annotations

import pytest

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams


def snapshot(pool: BlockPool) -> tuple:
    return (
        list(pool.ref_cnt),
        list(pool.block_hash),
        list(pool.free_queue),
        dict(pool.cached),
    )


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_fresh_pool_allocates_in_id_order():
    pool = BlockPool(10)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(0) == []
    assert pool.ref_cnt == [1] * 5 + [0] * 5
    assert list(pool.free_queue) == [5, 6, 7, 8, 9]
    pool.check_integrity(expected_refs={b: 1 for b in range(5)})


def test_freed_blocks_join_the_tail_of_the_free_queue():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1, 0, 2])
    assert list(pool.free_queue) == [3, 4, 5, 1, 0, 2]
    # never-used blocks first, then the freed ones in the order they were freed
    assert pool.allocate(6) == [3, 4, 5, 1, 0, 2]
    pool.check_integrity()


def test_manager_frees_a_request_tail_first():
    """A request's blocks [a, b, c] are freed as c, b, a: the prefix block a is the most
    recently freed and so the last to be evicted."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    req = Request("r", list(range(12)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, 12) == [0, 1, 2]
    kv.free("r")
    assert list(kv.pool.free_queue) == [3, 4, 5, 2, 1, 0]
    assert kv.pool.allocate(4) == [3, 4, 5, 2]
    assert kv.pool.allocate(2) == [1, 0]
    kv.pool.check_integrity(expected_refs={b: 1 for b in range(6)})


def test_touch_counts_references():
    pool = BlockPool(4)
    assert pool.allocate(1) == [0]
    pool.touch([0])
    pool.touch([0])
    assert pool.ref_cnt[0] == 3
    pool.free([0])
    pool.free([0])
    assert pool.ref_cnt[0] == 1
    assert 0 not in pool.free_queue
    pool.check_integrity(expected_refs={0: 1})
    pool.free([0])
    assert pool.ref_cnt[0] == 0
    assert list(pool.free_queue) == [1, 2, 3, 0]
    pool.check_integrity()


def test_touch_takes_a_free_block_out_of_the_free_queue():
    pool = BlockPool(4)
    pool.touch([2])
    assert pool.ref_cnt[2] == 1
    assert list(pool.free_queue) == [0, 1, 3]
    assert pool.allocate(3) == [0, 1, 3]
    pool.check_integrity(expected_refs={0: 1, 1: 1, 2: 1, 3: 1})


def test_cached_block_is_reusable_by_hash_after_free():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, 1000)
    pool.cache_block(1, 1001)
    assert pool.lookup(1000) == 0
    assert pool.lookup(1001) == 1
    assert pool.lookup(1002) is None
    pool.free([1, 0])
    # cached and free: still found, and counted as allocatable
    assert pool.lookup(1000) == 0
    assert pool.num_free_blocks == 4
    pool.check_integrity()
    # a hit takes it back without changing its content hash
    pool.touch([0])
    assert pool.ref_cnt[0] == 1
    assert pool.block_hash[0] == 1000
    assert list(pool.free_queue) == [2, 3, 1]
    pool.check_integrity(expected_refs={0: 1})


def test_cached_block_stays_until_evicted():
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    pool.cache_block(0, 7)
    pool.free([0])
    assert pool.allocate(2) == [1, 2]  # fresh blocks first: block 0 keeps its content
    assert pool.lookup(7) == 0
    assert pool.allocate(1) == [0]  # now it is evicted
    assert pool.lookup(7) is None
    assert pool.block_hash[0] is None
    assert pool.cached == {}
    pool.check_integrity(expected_refs={0: 1, 1: 1, 2: 1})


def test_eviction_takes_the_least_recently_freed_cached_block_first():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for b in range(4):
        pool.cache_block(b, 100 + b)
    for b in (2, 0, 3, 1):  # freed at different times
        pool.free([b])
    assert list(pool.free_queue) == [2, 0, 3, 1]

    assert pool.allocate(1) == [2]
    assert pool.lookup(102) is None
    assert [pool.lookup(h) for h in (100, 101, 103)] == [0, 1, 3]

    # a hit refreshes nothing by itself, but freeing again moves the block to the tail
    pool.touch([0])
    pool.free([0])
    assert list(pool.free_queue) == [3, 1, 0]
    assert pool.allocate(2) == [3, 1]
    assert pool.lookup(100) == 0
    assert pool.lookup(101) is None
    assert pool.lookup(103) is None
    pool.check_integrity(expected_refs={1: 1, 2: 1, 3: 1})


def test_allocate_returns_none_without_changing_anything():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, 5)
    pool.free([0])
    before = snapshot(pool)
    assert not pool.can_allocate(4)
    assert pool.allocate(4) is None
    assert snapshot(pool) == before
    assert pool.can_allocate(3)
    assert pool.allocate(3) == [2, 3, 0]
    pool.check_integrity(expected_refs={0: 1, 1: 1, 2: 1, 3: 1})


def test_double_free_raises():
    pool = BlockPool(4)
    assert pool.allocate(1) == [0]
    pool.free([0])
    with pytest.raises(ValueError, match="block 0"):
        pool.free([0])
    with pytest.raises(ValueError, match="block 3"):
        pool.free([3])  # never allocated
    pool.check_integrity()


def test_cache_block_keeps_the_first_block_of_a_content():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, 9)
    pool.cache_block(1, 9)  # same content computed twice
    assert pool.lookup(9) == 0
    assert pool.block_hash[1] is None
    pool.cache_block(0, 10)  # a block's hash never changes once set
    assert pool.block_hash[0] == 9
    assert pool.lookup(10) is None
    pool.check_integrity(expected_refs={0: 1, 1: 1})


def test_prefix_caching_disabled_caches_nothing():
    pool = BlockPool(4, enable_prefix_caching=False)
    assert pool.allocate(1) == [0]
    pool.cache_block(0, 9)
    assert pool.lookup(9) is None
    assert pool.block_hash == [None] * 4
    pool.check_integrity(expected_refs={0: 1})


def test_reset_prefix_cache():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, 1)
    pool.cache_block(1, 2)
    pool.free([1])
    pool.reset_prefix_cache()
    assert pool.cached == {}
    assert pool.block_hash == [None] * 4
    assert pool.ref_cnt == [1, 0, 0, 0]
    pool.check_integrity(expected_refs={0: 1})


def test_usage_and_free_counts():
    pool = BlockPool(10)
    assert pool.usage == 0.0
    assert pool.num_free_blocks == 10
    blocks = pool.allocate(3)
    assert pool.usage == pytest.approx(0.3)
    assert pool.num_free_blocks == 7
    pool.touch(blocks[:1])  # a second holder does not use another block
    assert pool.usage == pytest.approx(0.3)
    pool.cache_block(blocks[0], 1)
    pool.free(blocks)
    assert pool.usage == pytest.approx(0.1)  # blocks[0] still has one holder
    pool.free(blocks[:1])
    assert pool.usage == 0.0  # cached but free blocks are not in use
    assert pool.num_free_blocks == 10
    assert pool.allocate(10) is not None
    assert pool.usage == 1.0
    assert pool.num_free_blocks == 0


# -- check_integrity catches corruption ------------------------------------------------------


def test_check_integrity_passes_on_a_consistent_pool():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.cache_block(0, 3)
    pool.check_integrity()
    pool.check_integrity(expected_refs={0: 1, 1: 1})


def test_check_integrity_catches_a_referenced_block_in_the_free_queue():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.ref_cnt[3] = 1  # block 3 is in the free queue
    with pytest.raises(AssertionError, match="block 3"):
        pool.check_integrity()


def test_check_integrity_catches_an_unreferenced_block_outside_the_free_queue():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.ref_cnt[1] = 0
    with pytest.raises(AssertionError, match="block 1"):
        pool.check_integrity()


def test_check_integrity_catches_a_negative_ref_cnt():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.ref_cnt[2] = -1
    with pytest.raises(AssertionError, match="block 2 has ref_cnt -1"):
        pool.check_integrity()


def test_check_integrity_catches_a_hash_not_mapped_back():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.cache_block(0, 11)
    pool.cached[11] = 1
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()


def test_check_integrity_catches_a_stale_cache_entry():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.cached[99] = 2  # no block carries hash 99
    with pytest.raises(AssertionError, match="1 cached hashes but 0 hashed blocks"):
        pool.check_integrity()


def test_check_integrity_compares_with_what_owners_hold():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.touch([1])
    pool.check_integrity(expected_refs={0: 1, 1: 2})
    with pytest.raises(AssertionError, match="block 1: ref_cnt 2, owners hold 1"):
        pool.check_integrity(expected_refs={0: 1, 1: 1})
    with pytest.raises(AssertionError, match="block 2: ref_cnt 0, owners hold 1"):
        pool.check_integrity(expected_refs={0: 1, 1: 2, 2: 1})
