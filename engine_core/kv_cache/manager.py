"""Per-request view of the block pool: which blocks a request holds and what is cached.

    request tokens:  |<-------- num_computed_tokens -------->|<- new ->|
    blocks:          [ b7 ][ b2 ][ b9 ][ b4 ]  ...             (block_size tokens each)
                      full blocks are published by content hash once computed
"""

from __future__ import annotations

from engine_core.kv_cache.block_hash import hash_full_blocks
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_decoded_blocks: bool = False):
        """cache_decoded_blocks: publish full blocks that hold generated tokens too, not only
        the prompt's (see CacheConfig.cache_decoded_blocks)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_decoded_blocks = cache_decoded_blocks
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full blocks
        self.req_num_published: dict[str, int] = {}  # blocks already published in the cache

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, req_id: str) -> list[int]:
        return self.req_blocks.get(req_id, [])

    def _hashes(self, req: Request) -> list[int]:
        hashes = hash_full_blocks(
            req.all_token_ids, self.block_size, self.req_hashes.get(req.req_id, ())
        )
        self.req_hashes[req.req_id] = hashes
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request: (block ids, number of tokens). At least
        one token is always left to compute, since the last one yields the next logits."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        self.pool.num_cache_queries += min(len(hashes), max_blocks)
        self.pool.num_cache_hits += len(hit)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self, req: Request, num_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make the request hold enough blocks for its first `num_tokens` tokens, taking a
        reference on `computed_blocks` (a prefix-cache hit) first. Returns the newly allocated
        block ids, or None if the pool has no room (then nothing changed)."""
        blocks = self.req_blocks.get(req.req_id, [])
        have = len(blocks) + len(computed_blocks or ())
        need = cdiv(num_tokens, self.block_size) - have
        # a hit on a cached-but-free block also takes it out of the free queue
        num_evictable_hits = sum(self.pool.ref_cnt[b] == 0 for b in computed_blocks or ())
        if need > 0 and not self.pool.can_allocate(need + num_evictable_hits):
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = blocks + computed_blocks
            self.req_num_published[req.req_id] = len(computed_blocks)
        new = self.pool.allocate(need) if need > 0 else []
        assert new is not None
        self.req_blocks[req.req_id] = blocks + new
        return new

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish the request's full blocks whose KV is now computed: the prompt's only,
        unless cache_decoded_blocks (a block with a generated token was filled by decode)."""
        if not self.enable_prefix_caching:
            return
        num_computed = req.num_computed_tokens
        if not self.cache_decoded_blocks:
            num_computed = min(num_computed, req.num_prompt_tokens)
        num_full = num_computed // self.block_size
        done = self.req_num_published.get(req.req_id, 0)
        if num_full <= done:
            return
        hashes = self._hashes(req)
        blocks = self.req_blocks[req.req_id]
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.req_num_published[req.req_id] = num_full

    def free(self, req_id: str) -> None:
        """Release every block the request holds (idempotent)."""
        blocks = self.req_blocks.pop(req_id, [])
        self.pool.free(reversed(blocks))
        self.req_hashes.pop(req_id, None)
        self.req_num_published.pop(req_id, None)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(expected_refs=refs)
