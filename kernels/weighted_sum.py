"""Triton kernel of the cuda_ipc handoff's checksum (`weighted_sum32` in kv_transfer/checksum.py),
fused: each 32-bit word is read once, its two 16-bit halves weighed by the word's position,
and the products summed exactly in int64, one partial sum per program.

    word i of the checksummed bytes, in destination-block order
    sum over i of  (w_i & 0xFFFF) * low(i mod 2^16) + (w_i >> 16) * high(i mod 2^16)
    low(k) = ((k * 40503 + 1) & 0xFFFF) | 1,  high(k) = ((k * 30011 + 12345) & 0xFFFF) | 1

Grid: (blocks, tiles of a block). With block ids, program (j, t) reads tile t of pool block
ids[j], which is word j * block_words + offset of the sequence (the receiver's destination
blocks, summed in place: no gathered copy); without, block j of the tensor itself. The torch
code in checksum.py is the reference: integer sums are exact (mod 2^64), so any order of them
gives its value. The reference's dozen torch kernels per 4M words, and its weight table,
become one launch and a sum of the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import launchable

MAX_TILE = 4096  # words per program


@triton.jit
def _weighted_sum_kernel(words_ptr, block_ids_ptr, partial_ptr, block_words,
                         GATHER: tl.constexpr, TILE: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    mask = offs < block_words
    if GATHER:  # noqa: SIM108 (Triton: a constexpr branch as a statement)
        block = tl.load(block_ids_ptr + j).to(tl.int64)
    else:
        block = j
    words = tl.load(words_ptr + block * block_words + offs, mask=mask, other=0)
    words = words.to(tl.int64) & 0xFFFFFFFF  # the word's bits, unsigned
    k = (j * block_words + offs) & 0xFFFF  # the word's position in the sequence, mod 2^16
    low = ((k * 40503 + 1) & 0xFFFF) | 1
    high = ((k * 30011 + 12345) & 0xFFFF) | 1
    terms = (words & 0xFFFF) * low + (words >> 16) * high  # masked words are 0: no terms
    tl.store(partial_ptr + j * tl.num_programs(1) + tile, tl.sum(terms, axis=0))


def weighted_sum_words(words: torch.Tensor, block_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted sum (a 0-d int64 tensor on words' device, not reduced mod 2^32) of
    words [num_blocks, block_words] int32, contiguous, taken in the order of `block_ids`
    (int64 on the same device) or, without them, of its rows."""
    if words.dtype != torch.int32 or words.dim() != 2 or not words.is_contiguous():
        raise ValueError(f"words must be contiguous int32 [blocks, words], got "
                         f"{words.dtype} {tuple(words.shape)}")
    if block_ids is not None and (block_ids.dtype != torch.int64
                                  or block_ids.device != words.device):
        raise ValueError("block_ids must be int64 on the words' device")
    num_blocks, block_words = words.shape
    n = num_blocks if block_ids is None else block_ids.numel()
    tile = min(MAX_TILE, max(16, triton.next_power_of_2(block_words)))
    tiles = triton.cdiv(block_words, tile)
    partial = torch.zeros((max(n, 1), tiles), dtype=torch.int64, device=words.device)
    if n and block_words:
        kernel = launchable(_weighted_sum_kernel, words.device)
        kernel[(n, tiles)](words, words if block_ids is None else block_ids, partial,
                           block_words, GATHER=block_ids is not None, TILE=tile)
    return partial.sum()
