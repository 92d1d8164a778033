"""The scheduler's side of the offload tiers (engine_core/kv_offload/): the requests whose
blocks come back from a tier, and those a preemption sends there.

    waiting, its prefix missed by the pool
      -> start(): the tiers hold k more blocks   ->  blocks for them, WAITING_FOR_OFFLOAD,
                                                     load() queued (None: no room; the answer
                                                     is kept, not asked again each step)
    load done -> finish(): the blocks that loaded ->  published, the rest given back; the
                                                     request goes first in the waiting queue
    ended while loading -> abandon()             ->  an orphan: its blocks are being written,
                                                     freed when its load is done
    preempted -> swap_out()                      ->  its blocks never queued for the tiers
                                                     (its reply's unless cache_decoded_blocks,
                                                     under keys of its own; on a decode worker
                                                     the prompt's it received) copied out
                                                     before they are freed

The step goes on without a loading request, as vLLM's connector parks one in
WAITING_FOR_REMOTE_KVS; a loaded request waits first in line with those blocks computed, as
a fork does (scheduler.py).
"""

from __future__ import annotations

from typing import Protocol

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request, RequestStatus


class OffloadTiers(Protocol):
    """What the scheduler asks of the offload tiers (kv_offload/offloader.py)."""

    def lookup(self, hashes: list[int]) -> int:
        """How many of these consecutive blocks, from the first, the tiers hold."""

    def load(self, req_id: str, block_ids: list[int], hashes: list[int]) -> None:
        """Fill these blocks from the tiers, off the step path."""

    def swap_out(self, blocks: list[tuple[int, int]]) -> None:
        """Copy these (block id, key) now, store them off the step path (they are freed
        next)."""


class TierLoads:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.offload: OffloadTiers | None = None  # set by an engine with tiers
        self.loading: dict[str, Request] = {}  # WAITING_FOR_OFFLOAD: blocks held, KV loading
        self.orphans: set[str] = set()  # ended while loading: blocks freed when done

    def start(self, req: Request, hit_blocks: list[int]) -> bool | None:
        """Ask the tiers for the blocks after the pool's hit; if they hold any, give the
        request blocks for them and park it while they load (True: the caller takes it out
        of the waiting queue). None: they hold some but the pool has no room now (nothing
        changed but the answer, kept: the tiers are not asked again, a Redis round trip each
        step, while the pool's hit is the same; should they have evicted blocks since, the
        load stops short and the request computes them)."""
        bs = self.kv.block_size
        first, max_blocks = len(hit_blocks), (req.num_tokens - 1) // bs
        hashes = self.kv.tier_hashes(req)[first:max_blocks]
        if req.tier_hit is not None and req.tier_hit[0] == first:
            k = req.tier_hit[1]
        else:
            k = self.offload.lookup(hashes) if hashes else 0
        req.tier_hit = None
        if k == 0:
            req.tiers_checked = True
            return False
        if self.kv.allocate_slots(req, (first + k) * bs, hit_blocks) is None:
            req.tier_hit = (first, k)
            return None
        req.tiers_checked = True
        req.status = RequestStatus.WAITING_FOR_OFFLOAD
        req.num_loading_blocks = k
        self.loading[req.req_id] = req
        self.offload.load(req.req_id, self.kv.block_ids(req.req_id)[first:first + k], hashes[:k])
        return True

    def finish(self, req_id: str, num_loaded: int) -> Request | None:
        """The request's load is done: the first `num_loaded` of its loading blocks hold their
        KV (the rest are given back, and the loaded ones serve prefix hits). Returns it, to
        wait first in line with them computed; None for an orphan (its blocks are freed)."""
        if req_id in self.orphans:
            self.orphans.discard(req_id)
            self.kv.free(req_id)
            return None
        req = self.loading.pop(req_id)
        blocks = self.kv.block_ids(req_id)
        keep = len(blocks) - req.num_loading_blocks + num_loaded
        req.num_loading_blocks = 0
        self.kv.truncate(req_id, keep)
        req.num_computed_tokens = keep * self.kv.block_size
        self.kv.cache_computed_blocks(req)
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return req

    def abandon(self, req: Request) -> None:
        """A loading request ended: its blocks stay until its load is done (finish)."""
        del self.loading[req.req_id]
        self.orphans.add(req.req_id)

    def swap_out(self, req: Request) -> None:
        """A request about to be preempted: its blocks never queued for the tiers, to them."""
        if self.offload is not None:
            swapped = self.kv.swap_out(req)
            if swapped:
                self.offload.swap_out(swapped)
