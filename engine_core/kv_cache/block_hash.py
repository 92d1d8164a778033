"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

    hash[i] = H(hash[i-1] || token_ids of block i)          (hash[-1] = seed)

Stable across processes and hosts (blake2b, not Python's `hash`): the gateway computes the same
hashes to route a prompt to the worker that already holds its prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, parent_hashes: Sequence[int] = ()
) -> list[int]:
    """Hashes of every full block of `token_ids`, continuing after `parent_hashes` (the
    hashes already known for the first len(parent_hashes) blocks)."""
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def private_block_hash(block_hash: int, owner: str) -> int:
    """A block's key for one request only (its reply's KV where decoded blocks are not
    shared: swapped out to the offload tiers when it is preempted, loaded back by it alone)."""
    h = hashlib.blake2b(digest_size=8, person=b"pdserve-swap")
    h.update(block_hash.to_bytes(8, "little"))
    h.update(owner.encode())
    return int.from_bytes(h.digest(), "little")
