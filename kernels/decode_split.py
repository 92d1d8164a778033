"""Split-K (flash decoding) support for the paged decode kernel: how many splits, and the
kernel that combines their partial outputs.

A decode step has one query token per sequence, so the unsplit grid (num_seqs x num_kv_heads)
can be smaller than the SM count: 32 sequences x 3 KV heads is 96 programs on 132 SMs. Split
each sequence's context into NUM_SPLITS contiguous chunks, one program each:

    walked positions [lo, context_len), split_len = cdiv(cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split s walks [lo + s * split_len, min(lo + (s + 1) * split_len, context_len))
    |---- split 0 ----|---- split 1 ----|-- split 2 --|  (split 3: empty)

Split s writes its normalised partial output o_s = acc_s / l_s and its log-sum-exp
lse_s = m_s + log(l_s) (-inf when empty). The combine is exact:

    out = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M),   M = max_s lse_s

Split 0 is never empty (context_len ≥ 1), so M is finite. The number of splits depends only on
shapes and the device (never on the lengths' values), so a CUDA graph captured for a batch size
replays for any lengths, and the scratch is sized [num_seqs, num_q_heads, NUM_SPLITS, ...].
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# PDSERVE_DECODE_SPLITS: "auto" (the default) splits as below; a number fixes the count (1:
# the unsplit kernel everywhere).
ENV = "PDSERVE_DECODE_SPLITS"

# programs to aim for per SM when the unsplit grid is under one wave: several waves hide the
# tail of uneven splits
PROGRAMS_PER_SM = 4
MAX_SPLITS = 32
# a split shorter than this many positions costs more in its partial write than it saves
MIN_SPLIT_LEN = 128


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_context_splits(
    num_seqs: int,
    num_kv_heads: int,
    device: torch.device,
    window: int | None = None,
    max_context_len: int | None = None,
) -> int:
    """With PDSERVE_DECODE_SPLITS=auto (the default), where the unsplit grid (num_seqs x
    num_kv_heads programs) is smaller than the SM count: the splits per sequence that give
    the grid PROGRAMS_PER_SM programs per SM. 1 where it fills the SMs, on CPU (the
    interpreter has no SMs), or where the window or max_context_len (a host-side bound on the
    lengths, e.g. the step's `decode_max_len`; None: unknown) is too short to split. A number
    in PDSERVE_DECODE_SPLITS is used as it is.

    Measured on an H200 (132 SMs) in a CUDA graph, 32 sequences x 2,048 positions: SmolLM2's
    96 programs took 31 us unsplit and 16 us in 6 splits; Llama-3-8B's 256 took 67 us
    unsplit and 73 us in 3. Depends on shapes and bounds only, never on the lengths on the
    device, so it is fixed within a CUDA graph."""
    setting = os.environ.get(ENV, "auto")
    if setting != "auto":
        try:
            return max(1, int(setting))
        except ValueError:
            raise ValueError(f"{ENV} must be 'auto' or a whole number >= 1, got "
                             f"{setting!r}") from None
    if device.type != "cuda" or num_seqs == 0:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sm_count, programs = _sm_count(index), num_seqs * num_kv_heads
    if programs >= sm_count:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(PROGRAMS_PER_SM * sm_count, programs))
    for bound in (window, max_context_len):
        if bound is not None:
            splits = min(splits, triton.cdiv(bound, MIN_SPLIT_LEN))
    return max(1, splits)


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    partial_ptr,
    lse_ptr,
    stride_out_seq,
    stride_out_head,
    stride_out_dim,
    stride_partial_seq,
    stride_partial_head,
    stride_partial_split,
    stride_partial_dim,
    stride_lse_seq,
    stride_lse_head,
    stride_lse_split,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        lse_ptr + seq * stride_lse_seq + head * stride_lse_head + offs_s * stride_lse_split,
        mask=mask_s,
        other=float("-inf"),
    )  # [BLOCK_S]
    weights = tl.exp(lse - tl.max(lse, axis=0))  # [BLOCK_S], 0 for empty or masked splits
    partial = tl.load(
        partial_ptr
        + seq * stride_partial_seq
        + head * stride_partial_head
        + offs_s[:, None] * stride_partial_split
        + offs_d[None, :] * stride_partial_dim,
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)  # [BLOCK_D]
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d * stride_out_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def combine_splits(out: torch.Tensor, partial: torch.Tensor, lse: torch.Tensor, kernel) -> None:
    """Write into out [num_seqs, num_q_heads, head_dim] the exact softmax-weighted sum of the
    splits' partial outputs [num_seqs, num_q_heads, num_splits, head_dim] (fp32) by their
    log-sum-exps [num_seqs, num_q_heads, num_splits] (fp32). `kernel`: the launchable
    `_combine_splits_kernel`."""
    num_seqs, num_q_heads, num_splits, head_dim = partial.shape
    assert lse.shape == (num_seqs, num_q_heads, num_splits) and out.shape[:2] == lse.shape[:2]
    kernel[(num_seqs, num_q_heads)](
        out,
        partial,
        lse,
        *out.stride(),
        *partial.stride(),
        *lse.stride(),
        NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
