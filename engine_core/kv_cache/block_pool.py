"""The pool of physical KV blocks: free list, reference counts, prefix cache, LRU eviction.

A block is in exactly one of these states:

    in use    ref_cnt > 0                 (held by one or more requests)
    cached    ref_cnt == 0, hash set      (in the free queue, reusable by hash until evicted)
    free      ref_cnt == 0, no hash       (in the free queue)

The free queue is ordered least-recently-freed first, so allocation evicts the coldest cached
block. Blocks of one request are freed tail first: a prefix outlives its continuations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_cache_queries = 0  # blocks looked up by hash
        self.num_cache_hits = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free or evictable cached)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def lookup(self, block_hash: int) -> int | None:
        """The cached block with this content hash, if any (does not take a reference)."""
        return self.cached.get(block_hash)

    # -- verbs -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref_cnt 1, or None when there is no room (nothing changes)."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise ValueError(f"block {b} freed more times than it was referenced")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Publish a full, computed block under its content hash; False if it was published
        already, or another block holds the same content (the first is kept)."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return False
        if block_hash in self.cached:
            return False
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            del self.cached[block_hash]
            self.block_hash[block_id] = None

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            del self.cached[h]
            self.block_hash[block_id] = None

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError naming the disagreeing numbers. `expected_refs`, when given,
        is what the owners of blocks believe (block id -> number of holders)."""
        free = set(self.free_queue)
        if len(free) != len(self.free_queue):
            raise AssertionError("free queue holds a block twice")
        for b in range(self.num_blocks):
            if self.ref_cnt[b] < 0:
                raise AssertionError(f"block {b} has ref_cnt {self.ref_cnt[b]}")
            if (self.ref_cnt[b] == 0) != (b in free):
                raise AssertionError(
                    f"block {b}: ref_cnt {self.ref_cnt[b]} but in free queue: {b in free}"
                )
            h = self.block_hash[b]
            if h is not None and self.cached.get(h) != b:
                raise AssertionError(f"block {b} has hash {h} not mapped back to it")
        if len(self.cached) != sum(h is not None for h in self.block_hash):
            raise AssertionError(
                f"{len(self.cached)} cached hashes but "
                f"{sum(h is not None for h in self.block_hash)} hashed blocks"
            )
        if expected_refs is not None:
            for b in range(self.num_blocks):
                if self.ref_cnt[b] != expected_refs.get(b, 0):
                    raise AssertionError(
                        f"block {b}: ref_cnt {self.ref_cnt[b]}, owners hold "
                        f"{expected_refs.get(b, 0)}"
                    )
