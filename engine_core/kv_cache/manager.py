"""Per-request view of the block pool: which blocks a request holds and what is cached.

    request tokens:  |<-------- num_computed_tokens -------->|<- new ->|
    blocks:          [ b7 ][ b2 ][ b9 ][ b4 ]  ...             (block_size tokens each)
                      full blocks are published by content hash once computed

Forks (the n samples of one prompt) share the prompt's blocks by reference:

    parent:   [ b7 ][ b2 ][ b9:partial ]       b7, b2, b9 ref_cnt 3
    child 1:  [ b7 ][ b2 ][ b9:partial ]
    child 2:  [ b7 ][ b2 ][ b9:partial ]
    child 1 writes its next token  -> [ b7 ][ b2 ][ b5 ]  copy b9 -> b5 first, b9 ref_cnt 2

Invariant: a block that is shared (ref_cnt > 1) or published (hashed) is never written. A
request about to write into one gets a fresh block instead, and the (src, dst) pair is queued
in `pending_copies`; the engine copies those on its device before the step's forward.
"""

from __future__ import annotations

from engine_core.kv_cache.block_hash import hash_full_blocks, private_block_hash
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
        # leading blocks published without being queued for the offload tiers (their KV was
        # computed elsewhere: cache_computed_blocks(offload=False))
        self.req_num_received: dict[str, int] = {}
        # copy-on-write: (src, dst) block copies the next forward must be preceded by, and
        # the requests whose block lists changed in place (not only appended) since then
        self.pending_copies: list[tuple[int, int]] = []
        self.rewritten_req_ids: set[str] = set()
        # offload tiers (engine_core/kv_offload/): blocks published since the last
        # take_published (None: not collected), and references held while a block is stored
        self.published: list[tuple[int, int]] | None = None
        self.pinned: dict[int, int] = {}

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
        reference on `computed_blocks` (a prefix-cache hit) first, and own every block it will
        write (from num_computed_tokens on): a shared or published one is copied on write.
        Returns the newly allocated block ids, or None if the pool has no room (then nothing
        changed)."""
        blocks = self.req_blocks.get(req.req_id, [])
        bs = self.block_size
        if not computed_blocks and blocks and (num_tokens + bs - 1) // bs <= len(blocks) \
                and req.num_computed_tokens // bs == len(blocks) - 1 \
                and not self._is_immutable(blocks[-1]):
            return []  # a decode in its last, private block: the common case, no change
        have = len(blocks) + len(computed_blocks or ())
        need = max(cdiv(num_tokens, self.block_size) - have, 0)
        # held blocks the request writes into (computed_blocks lie before num_computed_tokens)
        first_written = req.num_computed_tokens // self.block_size
        to_copy = [i for i in range(first_written, len(blocks)) if self._is_immutable(blocks[i])]
        # a hit on a cached-but-free block also takes it out of the free queue
        num_evictable_hits = sum(self.pool.ref_cnt[b] == 0 for b in computed_blocks or ())
        if (need or to_copy) and not self.pool.can_allocate(
                need + len(to_copy) + num_evictable_hits):
            return None
        if to_copy:
            blocks = list(blocks)
            for i in to_copy:
                (dst,) = self.pool.allocate(1) or ()
                self.pool.free([blocks[i]])
                self.pending_copies.append((blocks[i], dst))
                blocks[i] = dst
            self.rewritten_req_ids.add(req.req_id)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks = blocks + computed_blocks
            self.req_num_published[req.req_id] = len(computed_blocks)
        new = self.pool.allocate(need) if need > 0 else []
        assert new is not None
        self.req_blocks[req.req_id] = blocks + new
        return new

    def _is_immutable(self, block_id: int) -> bool:
        """Shared with another request, or published in the prefix cache: never written."""
        return self.pool.ref_cnt[block_id] > 1 or self.pool.block_hash[block_id] is not None

    def fork(self, parent: Request, child: Request) -> None:
        """The child (same prompt) takes a reference on each of the parent's prompt blocks,
        whose KV is computed; a write into the shared last one copies it first."""
        num_blocks = cdiv(parent.num_prompt_tokens, self.block_size)
        blocks = self.req_blocks[parent.req_id][:num_blocks]
        assert len(blocks) == num_blocks and child.req_id not in self.req_blocks
        self.pool.touch(blocks)
        self.req_blocks[child.req_id] = list(blocks)
        num_full = parent.num_prompt_tokens // self.block_size
        if parent.req_id in self.req_hashes:
            self.req_hashes[child.req_id] = self.req_hashes[parent.req_id][:num_full]
        self.req_num_published[child.req_id] = min(
            self.req_num_published.get(parent.req_id, 0), num_full)
        if parent.req_id in self.req_num_received:
            self.req_num_received[child.req_id] = min(self.req_num_received[parent.req_id],
                                                      num_full)

    def take_copies(self) -> tuple[list[tuple[int, int]], set[str]]:
        """The copies queued since the last call and the requests whose block lists were
        rewritten in place; both cleared."""
        copies, self.pending_copies = self.pending_copies, []
        rewritten, self.rewritten_req_ids = self.rewritten_req_ids, set()
        return copies, rewritten

    def cache_computed_blocks(self, req: Request, offload: bool = True) -> None:
        """Publish the request's full blocks whose KV is now computed: the prompt's only,
        unless cache_decoded_blocks (a block with a generated token was filled by decode).
        offload=False: in the pool only, not queued for the offload tiers (KV a prefill worker
        computed and stores itself; swap_out copies them out should the request be
        preempted)."""
        if not self.enable_prefix_caching:
            return
        # (async scheduling counts tokens not read yet as computed: only known ones hash)
        num_computed = min(req.num_computed_tokens, len(req.all_token_ids))
        if not self.cache_decoded_blocks:
            num_computed = min(num_computed, len(req.prompt_token_ids))
        num_full = num_computed // self.block_size
        if num_full <= self.req_num_published.get(req.req_id, 0):
            return
        done = self.req_num_published.get(req.req_id, 0)
        hashes = self._hashes(req)
        blocks = self.req_blocks[req.req_id]
        published = self.published if offload else None
        for i in range(done, num_full):
            if self.pool.cache_block(blocks[i], hashes[i]) and published is not None:
                published.append((blocks[i], hashes[i]))
        self.req_num_published[req.req_id] = num_full
        if not offload:
            self.req_num_received[req.req_id] = num_full

    # -- offload tiers ------------------------------------------------------------------------
    def tier_hashes(self, req: Request) -> list[int]:
        """The keys of the request's full blocks in the offload tiers: the chained hashes of
        the blocks it publishes (shared), then, beyond them (its reply's blocks, unless
        cache_decoded_blocks), keys private to it (swap_out stored them)."""
        hashes = self._hashes(req)
        num_shared = (len(hashes) if self.cache_decoded_blocks
                      else len(req.prompt_token_ids) // self.block_size)
        return hashes[:num_shared] + [private_block_hash(h, req.req_id)
                                      for h in hashes[num_shared:]]

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """(block id, key) of the full blocks of a request about to be preempted that were
        never queued for the tiers: the prompt blocks it received (admit_prefilled), under
        their shared keys, and its reply's unpublished ones (unless cache_decoded_blocks),
        under keys private to it."""
        if not self.enable_prefix_caching:
            return []
        blocks = self.req_blocks.get(req.req_id, [])
        keys = self.tier_hashes(req)
        num_received = min(self.req_num_received.get(req.req_id, 0), len(blocks))
        out = [(blocks[i], keys[i]) for i in range(num_received)]
        if not self.cache_decoded_blocks:
            num_full = min(req.num_computed_tokens, len(req.all_token_ids)) // self.block_size
            first = len(req.prompt_token_ids) // self.block_size
            out += [(blocks[i], keys[i]) for i in range(first, min(num_full, len(blocks)))]
        return out

    def take_published(self) -> list[tuple[int, int]]:
        """(block id, hash) of the blocks published since the last call (collected only
        once `published` is a list: an engine with offload tiers sets it)."""
        out = self.published
        if not out:
            return []
        self.published = []
        return out

    def is_cached(self, block_id: int, block_hash: int) -> bool:
        """Whether the block still holds the content published under this hash."""
        return self.pool.block_hash[block_id] == block_hash

    def pin(self, block_ids: list[int]) -> None:
        """Hold the blocks (no request does) until `unpin`: not evicted, not rewritten."""
        self.pool.touch(block_ids)
        for b in block_ids:
            self.pinned[b] = self.pinned.get(b, 0) + 1

    def unpin(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self.pinned[b] == 1:
                del self.pinned[b]
            else:
                self.pinned[b] -= 1
        self.pool.free(block_ids)

    def truncate(self, req_id: str, num_blocks: int) -> None:
        """Keep only the request's first `num_blocks` blocks (a load that stopped short)."""
        blocks = self.req_blocks[req_id]
        self.pool.free(reversed(blocks[num_blocks:]))
        del blocks[num_blocks:]
        if self.req_num_published.get(req_id, 0) > num_blocks:
            self.req_num_published[req_id] = num_blocks
        if self.req_num_received.get(req_id, 0) > num_blocks:
            self.req_num_received[req_id] = num_blocks

    def free(self, req_id: str) -> None:
        """Release every block the request holds (idempotent)."""
        blocks = self.req_blocks.pop(req_id, [])
        if self.pending_copies and blocks:  # a copy into a block freed before its step ran
            dropped = set(blocks)
            self.pending_copies = [c for c in self.pending_copies if c[1] not in dropped]
        self.pool.free(reversed(blocks))
        self.req_hashes.pop(req_id, None)
        self.req_num_published.pop(req_id, None)
        self.req_num_received.pop(req_id, None)

    def check_integrity(self) -> None:
        refs: dict[int, int] = dict(self.pinned)
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(expected_refs=refs)
