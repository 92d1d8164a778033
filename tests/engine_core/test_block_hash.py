"""Chained block hashes: a block's hash names its whole prefix, and only full blocks get one."""

from __future__ import annotations

import hashlib

import pytest

from engine_core.kv_cache.block_hash import ROOT_HASH, hash_block, hash_full_blocks

BLOCK_SIZE = 4

# Pinned outputs. blake2b over fixed little-endian bytes is deterministic by construction, so a
# change here means the hash function changed: every worker and the gateway must then change
# together (prefix routing compares these numbers across processes and hosts).
PINNED_TOKENS = list(range(8))
PINNED_HASHES = [2141542520064864664, 15377408733496924908]
PINNED_HASH_1234 = 2821693476514209883  # hash_block(ROOT_HASH, [1, 2, 3, 4])


def test_pinned_values():
    # computed once in another process: a salted or per-process hash would not reproduce them
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == PINNED_HASH_1234
    assert hash_full_blocks(PINNED_TOKENS, BLOCK_SIZE) == PINNED_HASHES


def test_hash_block_matches_its_definition():
    """H = blake2b-64(parent as 8 little-endian bytes || token ids as int64 little-endian)."""
    parent, tokens = 123456789, [7, 0, 2**40, 5]
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    for t in tokens:
        h.update(t.to_bytes(8, "little", signed=True))
    assert hash_block(parent, tokens) == int.from_bytes(h.digest(), "little")


def test_chain_definition():
    tokens = list(range(100, 112))
    expected, parent = [], ROOT_HASH
    for i in range(3):
        parent = hash_block(parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        expected.append(parent)
    assert hash_full_blocks(tokens, BLOCK_SIZE) == expected


@pytest.mark.parametrize("changed_pos", range(12))
def test_block_hash_depends_on_every_earlier_token(changed_pos):
    tokens = list(range(100, 112))
    changed = list(tokens)
    changed[changed_pos] += 1
    a = hash_full_blocks(tokens, BLOCK_SIZE)
    b = hash_full_blocks(changed, BLOCK_SIZE)
    changed_block = changed_pos // BLOCK_SIZE
    # blocks before the change keep their hash; the changed block and all after it differ
    assert a[:changed_block] == b[:changed_block]
    for i in range(changed_block, 3):
        assert a[i] != b[i], f"block {i} did not notice a change at token {changed_pos}"


def test_same_block_content_at_different_positions_hashes_differently():
    tokens = [1, 2, 3, 4] * 3
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    assert len(set(hashes)) == 3


def test_token_order_matters():
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [4, 3, 2, 1])


@pytest.mark.parametrize("num_tokens, num_full", [(0, 0), (1, 0), (3, 0), (4, 1), (7, 1), (8, 2)])
def test_partial_blocks_are_not_hashed(num_tokens, num_full):
    tokens = list(range(num_tokens))
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    assert len(hashes) == num_full
    # the trailing partial block does not influence the full blocks' hashes
    assert hash_full_blocks(tokens + [999] * (BLOCK_SIZE - 1), BLOCK_SIZE)[:num_full] == hashes


@pytest.mark.parametrize("num_known", [0, 1, 2, 3])
def test_continuing_from_parent_hashes_equals_hashing_from_scratch(num_known):
    tokens = list(range(50, 64))  # 3 full blocks + 2 tokens
    scratch = hash_full_blocks(tokens, BLOCK_SIZE)
    assert len(scratch) == 3
    assert hash_full_blocks(tokens, BLOCK_SIZE, scratch[:num_known]) == scratch


def test_growing_sequence_incrementally():
    """The manager's use: hash as tokens arrive one at a time, reusing earlier hashes."""
    tokens = list(range(1000, 1023))
    hashes: list[int] = []
    for n in range(1, len(tokens) + 1):
        hashes = hash_full_blocks(tokens[:n], BLOCK_SIZE, hashes)
        assert hashes == hash_full_blocks(tokens[:n], BLOCK_SIZE)
    assert len(hashes) == 5


def test_parent_hashes_are_taken_as_given():
    """Known hashes are not recomputed (that is the point of passing them)."""
    tokens = list(range(8))
    fake = [42]
    assert hash_full_blocks(tokens, BLOCK_SIZE, fake) == [42, hash_block(42, tokens[4:8])]


def test_does_not_mutate_parent_hashes():
    parents = hash_full_blocks(list(range(4)), BLOCK_SIZE)
    before = list(parents)
    hash_full_blocks(list(range(12)), BLOCK_SIZE, parents)
    assert parents == before
