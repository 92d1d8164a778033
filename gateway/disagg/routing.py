"""Which prefill worker takes a prompt, and in which order decode workers are asked to
reserve it: pure functions of what the gateway knows.

Cost model, in KV blocks of prefill compute saved or spent:

    score(w) = overlap(w) - queue_weight * in_flight(w)

overlap(w) is how many of the prompt's leading full blocks w holds in its prefix cache (it skips
computing them); each request the gateway already has in flight on w delays this one by about
queue_weight blocks of compute (prefill batches share steps, so a queued request costs less than
its whole prompt). The highest score wins; ties go to the shorter queue, then to the worker the
prompt's first block picks (tie_key), so equal workers split the traffic and a shared prefix
keeps landing on the same cache.

Without prefix information (static discovery, Redis down) every overlap is 0 and this is the
shortest queue, ties by the first block.

A prefill worker with KV offload tiers (engine_core/kv_offload/) also holds blocks it stored
there: it loads them instead of computing them, which saves less than a pool hit does. Such a
block counts as the fraction of a block's compute its load saves (offload_weight):

    overlap(w) = pool(w) + (tiers(w) - pool(w)) * max(0, 1 - load_s / compute_s)

where tiers(w) >= pool(w) is the leading blocks held in the pool or the tiers, and the
ratio of the two per-token times is that of w's measured speeds: prefill tokens per second
over tier load tokens per second. Until w has loaded from its tiers, a tier block counts
whole (a load is assumed far cheaper than the compute; the first loads measure it).

Decode workers are ranked the same way, with their own weight:

    score(d) = overlap(d) - decode_queue_weight * in_flight(d)

overlap(d) is the leading prompt blocks d holds (published by decode workers: Redis, or their
Status). Holding them saves their transfer, and lets a short follow-up be prefilled on d
itself (gateway/disagg/prefill_policy.py); one more request in a decode batch costs far less than one
in a prefill queue (a decode row is one token), so the weight is lower. Ties go to the
shorter queue, then to the most free KV blocks. A multi-turn chat thus returns to the worker
that holds its history unless that worker is DECODE_QUEUE_WEIGHT_BLOCKS blocks per request
busier than another.
"""

from __future__ import annotations

from collections.abc import Sequence

QUEUE_WEIGHT_BLOCKS = 8.0  # one request in flight ~ 128 prompt tokens at block size 16
DECODE_QUEUE_WEIGHT_BLOCKS = 2.0  # one more decoding request ~ 32 prompt tokens held
MAX_ROUTING_BLOCKS = 128  # leading blocks asked about: longer overlaps count as equal


def pick_prefill(in_flight: Sequence[int], overlap: Sequence[float] | None, tie_key: int,
                 queue_weight: float = QUEUE_WEIGHT_BLOCKS) -> int:
    """The index of the chosen worker. in_flight[i], overlap[i]: worker i's requests in flight
    from this gateway and leading prompt blocks held (routing_overlap; None: unknown for
    all)."""
    if not in_flight:
        raise ValueError("no prefill worker to choose from")
    if overlap is None:
        overlap = [0] * len(in_flight)
    if len(overlap) != len(in_flight) or queue_weight < 0:
        raise ValueError(f"need one overlap per worker and queue_weight >= 0, got "
                         f"{len(overlap)} for {len(in_flight)} and {queue_weight}")
    scores = [o - queue_weight * q for o, q in zip(overlap, in_flight, strict=True)]
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if s == best]
    shortest = min(in_flight[i] for i in tied)
    tied = [i for i in tied if in_flight[i] == shortest]
    return tied[tie_key % len(tied)]


def rank_decode(in_flight: Sequence[int], free_blocks: Sequence[int],
                overlap: Sequence[int] | None,
                queue_weight: float = DECODE_QUEUE_WEIGHT_BLOCKS) -> list[int]:
    """Decode worker indices, best first (Reserve is tried in this order). in_flight[i],
    free_blocks[i], overlap[i]: worker i's requests from this gateway, free KV blocks and
    leading prompt blocks held (None: unknown for all)."""
    if overlap is None:
        overlap = [0] * len(in_flight)
    if not len(overlap) == len(in_flight) == len(free_blocks) or queue_weight < 0:
        raise ValueError(f"need one overlap and free count per worker and queue_weight >= 0, "
                         f"got {len(overlap)}, {len(free_blocks)} for {len(in_flight)} and "
                         f"{queue_weight}")
    return sorted(range(len(in_flight)), key=lambda i: (
        -(overlap[i] - queue_weight * in_flight[i]), in_flight[i], -free_blocks[i], i))


def offload_weight(prefill_tokens_per_s: float, load_tokens_per_s: float) -> float:
    """What one block a worker loads from its offload tiers saves, in blocks of its compute
    (routing's overlap unit); 1 while either speed is unmeasured."""
    if prefill_tokens_per_s <= 0 or load_tokens_per_s <= 0:
        return 1.0
    return max(0.0, 1.0 - prefill_tokens_per_s / load_tokens_per_s)


def routing_overlap(pool: int, held: int, weight: float) -> float:
    """A prefill worker's overlap for pick_prefill: `pool` leading blocks in its pool, `held`
    (>= pool) in its pool or offload tiers, tier blocks counted `weight` each."""
    return pool + max(0, held - pool) * weight


def leading_overlap(block_hashes: Sequence[int], *held: frozenset[int] | set[int]) -> int:
    """How many of the leading block_hashes one of the `held` sets contains (chain hashes: a
    block counts only if every block before it does)."""
    n = 0
    while n < len(block_hashes) and any(block_hashes[n] in h for h in held):
        n += 1
    return n
