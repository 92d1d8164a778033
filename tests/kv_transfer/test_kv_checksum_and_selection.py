"""Checksums (same on a gathered snapshot and on scattered blocks), chunk planning, and the
transport selection rules."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from kv_helpers import LAYOUTS, random_cache

from kv_transfer import TransportRefusedError, checksum_blocks, checksum_tensor, host_id, transports
from kv_transfer import select_transport as select
from kv_transfer.blocks import gather_blocks, scatter_blocks
from kv_transfer.checksum import checksum_blocks_as, checksum_tensor_as, weighted_sum32
from kv_transfer.transports.grpc import plan_chunks


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.dtype)
def test_checksum_of_snapshot_equals_checksum_of_scattered_blocks(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = random_cache(layout, 20, gen)
    ids = torch.randperm(20, generator=gen)[:7].tolist()
    snapshot = kv[1].index_select(0, torch.tensor(ids))  # [7, 2, bs, heads, dim]
    assert checksum_blocks(kv[1], ids) == checksum_tensor(snapshot)
    swapped = [ids[1], ids[0], *ids[2:]]  # same bytes, two blocks in the wrong place
    assert checksum_blocks(kv[1], swapped) != checksum_tensor(snapshot)
    kv[1, ids[3]].view(torch.uint8).view(-1)[5] ^= 1  # one bit
    assert checksum_blocks(kv[1], ids) != checksum_tensor(snapshot)


@pytest.mark.parametrize("kind", ["xxh3", "sum32"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.dtype)
def test_each_checksum_kind_catches_a_flipped_bit_and_a_misplaced_block(layout, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = random_cache(layout, 20, gen)
    ids = torch.randperm(20, generator=gen)[:7].tolist()
    snapshot = kv[1].index_select(0, torch.tensor(ids))
    want = checksum_tensor_as(kind, snapshot)
    assert checksum_blocks_as(kind, kv[1], ids) == want
    assert checksum_blocks_as(kind, kv[1], [ids[1], ids[0], *ids[2:]]) != want
    flat = kv[1, ids[3]].view(torch.uint8).view(-1)
    for byte in torch.randint(0, flat.numel(), (16,), generator=gen).tolist():
        for bit in (0, 7):
            flat[byte] ^= 1 << bit
            assert checksum_blocks_as(kind, kv[1], ids) != want, (byte, bit)
            flat[byte] ^= 1 << bit
    assert checksum_blocks_as(kind, kv[1], ids) == want


def test_weighted_sum32_is_the_exact_weighted_sum_of_half_words():
    words = torch.tensor([0xFFFFFFFF, 0, 0x12345678, 0x80000001] * 300, dtype=torch.int64)
    t = words.to(torch.uint32).view(torch.int32)
    want = 0
    for i, w in enumerate(words.tolist()):
        low, high = ((i * 40503 + 1) & 0xFFFF) | 1, ((i * 30011 + 12345) & 0xFFFF) | 1
        want += (w & 0xFFFF) * low + (w >> 16) * high
    assert weighted_sum32(t) == want % (1 << 32)
    with pytest.raises(ValueError, match="whole 32-bit words"):
        weighted_sum32(torch.zeros(3, dtype=torch.uint8))


def test_weighted_sum32_past_its_weights_period_and_across_chunks(monkeypatch):
    """The weights repeat every 2^16 words and the sum runs a chunk at a time: over 2.3
    periods, with chunks of two periods (one boundary inside), the same sum as the formula
    taken at every position directly."""
    from kv_transfer import checksum

    monkeypatch.setattr(checksum, "CHUNK_WORDS", 2 << 16)
    n = (2 << 16) + 20000
    g = torch.Generator().manual_seed(3)
    t = torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    w = t.numpy().astype(np.int64) & 0xFFFFFFFF
    i = np.arange(n, dtype=np.int64)
    low, high = ((i * 40503 + 1) & 0xFFFF) | 1, ((i * 30011 + 12345) & 0xFFFF) | 1
    want = int(((w & 0xFFFF) * low).sum() + ((w >> 16) * high).sum()) % (1 << 32)
    assert weighted_sum32(t) == want
    assert weighted_sum32(t[:1000]) != weighted_sum32(t[1:1001])  # position-dependent


def test_only_cuda_ipc_uses_the_device_checksum():
    kinds = [transports.get(k).checksum_kind for k in ("grpc", "shm", "cuda_ipc")]
    assert kinds == ["xxh3", "xxh3", "sum32"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.dtype)
@pytest.mark.parametrize("contiguous", [True, False])
def test_gather_and_scatter_match_torch_indexing(layout, contiguous, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = random_cache(layout, 12, gen)
    if not contiguous:  # the same values through a strided view: the torch fallback
        kv = random_cache(layout, 24, gen)[:, ::2]
        assert not kv.is_contiguous()
    ids = torch.randperm(12, generator=gen)[:5].tolist()
    blocks = gather_blocks(kv, 1, ids)
    assert blocks.is_contiguous() and torch.equal(blocks.view(torch.uint8),
                                                  kv[1, ids].contiguous().view(torch.uint8))
    # into a reused buffer (stale bytes of another layer): the same bytes, in that buffer
    spare = gather_blocks(kv, 0, ids)
    again = gather_blocks(kv, 1, ids, out=spare)
    assert again.data_ptr() == spare.data_ptr()
    assert torch.equal(again.view(torch.uint8), blocks.view(torch.uint8))
    with pytest.raises(ValueError, match="is not a contiguous"):
        gather_blocks(kv, 1, ids[:4], out=spare)
    with pytest.raises(IndexError):
        gather_blocks(kv, 1, [*ids[:4], kv.shape[1]], out=spare)
    other = torch.randperm(12, generator=gen)[:5].tolist()
    scatter_blocks(kv, 0, other, blocks)
    assert torch.equal(kv[0, other].contiguous().view(torch.uint8), blocks.view(torch.uint8))


@pytest.mark.parametrize(("num_blocks", "block_nbytes", "chunk_bytes"),
                         [(5, 100, 250), (5, 100, 100), (3, 100, 30), (1, 64, 1 << 20)])
def test_chunks_cover_the_layer_once_and_stay_bounded(num_blocks, block_nbytes, chunk_bytes):
    covered = []
    for first, count, offset, start, end in plan_chunks(num_blocks, block_nbytes, chunk_bytes):
        assert 0 < end - start <= chunk_bytes
        assert start == first * block_nbytes + offset
        assert count == 1 or (offset == 0 and end - start == count * block_nbytes)
        covered.append((start, end))
    assert covered[0][0] == 0 and covered[-1][1] == num_blocks * block_nbytes
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


@pytest.mark.parametrize(("requested", "hosts", "devices", "expected"), [
    ("auto", ("a", "a"), ("cuda:0", "cuda:1"), "cuda_ipc"),
    ("auto", ("a", "a"), ("cpu", "cpu"), "shm"),
    ("auto", ("a", "a"), ("cuda:0", "cpu"), "shm"),  # GPU sender copies into host shm
    ("auto", ("a", "a"), ("cpu", "cuda:0"), "grpc"),  # a GPU pool is not in host memory
    ("auto", ("a", "b"), ("cuda:0", "cuda:0"), "grpc"),
    ("auto", ("a", "b"), ("cpu", "cpu"), "grpc"),
    ("grpc", ("a", "a"), ("cpu", "cpu"), "grpc"),
    ("shm", ("a", "a"), ("cpu", "cpu"), "shm"),
    ("cuda_ipc", ("a", "a"), ("cuda", "cuda"), "cuda_ipc"),
])
def test_select_transport_rules(requested, hosts, devices, expected):
    assert select(requested, *hosts, *devices) == expected


@pytest.mark.parametrize(("requested", "hosts", "devices", "message"), [
    ("shm", ("a", "b"), ("cpu", "cpu"), "sender host a != receiver host b"),
    ("shm", ("a", "a"), ("cpu", "cuda:0"), "not in host shared memory"),
    ("cuda_ipc", ("a", "a"), ("cpu", "cpu"), "needs CUDA on both sides"),
    ("cuda_ipc", ("a", "b"), ("cuda", "cuda"), "sender host a != receiver host b"),
])
def test_impossible_explicit_choices_are_refused(requested, hosts, devices, message):
    with pytest.raises(ValueError, match=message):  # TransportRefusedError is a ValueError
        select(requested, *hosts, *devices)


def test_auto_respects_what_the_receiver_enabled_and_explicit_choices_do_not_fall_back():
    assert select("auto", "a", "a", "cpu", "cpu", allowed=("grpc",)) == "grpc"
    with pytest.raises(TransportRefusedError, match="not enabled"):
        select("shm", "a", "a", "cpu", "cpu", allowed=("grpc",))
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        select("tcp", "a", "a", "cpu", "cpu")


def test_host_id_is_stable_and_overridable(monkeypatch):
    monkeypatch.delenv("PDSERVE_HOST_ID", raising=False)
    first = host_id()
    assert first == host_id() and len(first) == 16
    monkeypatch.setenv("PDSERVE_HOST_ID", "test-host-7")
    assert host_id() == "test-host-7"


def test_chosen_transport_is_logged_on_both_sides(make_rig, caplog):
    from kv_transfer import connect

    rig = make_rig("shm", LAYOUTS[0])
    with caplog.at_level(logging.INFO, logger="pdserve.kv_transfer"), \
            connect("auto", rig.target, rig.layout) as conn:
        assert (conn.kind, conn.control) == ("shm", "unix")
    messages = [r.getMessage() for r in caplog.records]
    assert any("uses shm, control over unix (requested auto" in m and "sender host" in m
               for m in messages)
    assert any("kv transfer from host" in m and "uses shm" in m for m in messages)
