"""The cuda_ipc checksum's fused Triton kernel (kernels/weighted_sum.py) against the torch
reference in kv_transfer/checksum.py: gathered in block order, and over a whole tensor."""

from __future__ import annotations

import pytest
import torch

from kernels.weighted_sum import weighted_sum_words
from kv_transfer.checksum import _weighted_sum32_torch, checksum_blocks_as, weighted_sum32


def _reference(words: torch.Tensor, ids: list[int]) -> int:
    return _weighted_sum32_torch(words.cpu()[ids].reshape(-1))


def _sum32(words: torch.Tensor, ids: torch.Tensor | None = None) -> int:
    return int(weighted_sum_words(words, ids).item()) & 0xFFFFFFFF


@pytest.mark.parametrize("block_words", [3000, 9000])  # one tile; three, the last partial
def test_weighted_sum_triton_equals_the_torch_reference(triton_device, block_words):
    generator = torch.Generator().manual_seed(block_words)
    pool = torch.randint(-(1 << 31), (1 << 31) - 1, (40, block_words), generator=generator,
                         dtype=torch.int64).to(torch.int32)  # 120k-360k words: past 2^16
    ids = [5, 3, 39, 0, 7, 22, 11, 30, 2, 17, 25, 38]
    want = _reference(pool, ids)
    words = pool.to(triton_device)
    index = torch.tensor(ids, device=triton_device)
    assert _sum32(words, index) == want  # the destination blocks, read in place
    assert _sum32(words[index].contiguous()) == want  # a snapshot, block by block
    assert _sum32(words[index].reshape(1, -1).contiguous()) == want  # one flat run
    swapped = torch.tensor([ids[1], ids[0], *ids[2:]], device=triton_device)
    assert _sum32(words, swapped) != want  # order-sensitive
    flipped = words.clone()
    flipped[ids[4], block_words - 1] ^= 1 << 20  # one bit of the last word's high half
    assert _sum32(flipped, index) != want
    assert _sum32(words, index[:0]) == 0
    if triton_device.type == "cuda":  # what the transfer calls, fused there
        layer = words.view(40, 2, block_words // 2)
        assert checksum_blocks_as("sum32", layer, index) == want
        assert checksum_blocks_as("sum32", layer, ids) == want
        assert weighted_sum32(words[index]) == want


def test_weighted_sum_triton_refuses_what_it_cannot_read(triton_device):
    with pytest.raises(ValueError, match="int32"):
        weighted_sum_words(torch.zeros(2, 8, dtype=torch.int64, device=triton_device))
    with pytest.raises(ValueError, match="block_ids"):
        weighted_sum_words(torch.zeros(2, 8, dtype=torch.int32, device=triton_device),
                           torch.zeros(1, dtype=torch.int32, device=triton_device))
