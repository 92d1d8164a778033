"""The prefix blocks a worker holds recently, for routing: a multi-turn chat returns to the
decode worker that holds its history (gateway/disagg/decode_admission.py), a prompt goes to the
prefill worker that caches its prefix, and a remote prefill's cost counts only what that
worker lacks (gateway/disagg/prefill_placement.py).

    add(hashes)   the full blocks of a prompt whose KV is now in this worker's prefix cache
                  (claimed from a transfer or prefilled, on a decode worker; prefilled, on a
                  prefill worker)
    hashes()      what is published in Status (gateways without Redis read it there);
                  with Redis the worker publishes the same hashes to its registration

Bounded like a worker's Redis set: at most `capacity` hashes (the pool's blocks), newest
kept, each for ttl_s. A hash may outlive its block (evicted by LRU): it is a routing hint,
and a miss only costs the prefill the hint promised to save.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from service_infra.redis_registry import PREFIX_TTL_S

# the most blocks recorded as stored in a worker's offload tiers (a prefill worker's Status
# lists them without Redis: ~10 bytes each; 256k tokens at block size 16)
MAX_OFFLOAD_RECORD_BLOCKS = 16384


class PrefixRecord:
    def __init__(self, capacity: int, ttl_s: float = PREFIX_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or ttl_s <= 0:
            raise ValueError(f"capacity must be >= 1 and ttl_s > 0, got {capacity} and {ttl_s}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._expiry: OrderedDict[int, float] = OrderedDict()  # hash -> expiry, oldest first

    def add(self, block_hashes: Sequence[int]) -> None:
        expires = self._clock() + self.ttl_s
        for h in block_hashes:
            self._expiry.pop(h, None)
            self._expiry[h] = expires
        while len(self._expiry) > self.capacity:
            self._expiry.popitem(last=False)

    def hashes(self) -> list[int]:
        """The unexpired hashes, oldest first (expired ones are dropped here)."""
        now = self._clock()
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)
        return list(self._expiry)
