"""Triton paged decode attention: one query token per sequence over its cached K/V.

Grid: (num_seqs, num_kv_heads, num_splits). A program owns one KV head of one sequence and all
GROUP_SIZE query heads that share it (GQA), so every K/V tile is loaded once per group, over
one split of the context (kernels/decode_split.py: with NUM_SPLITS > 1 each program writes a
partial output and its log-sum-exp, and a second kernel combines them). It walks its split in
tiles of BLOCK_N positions; each position finds its cache row through the block
table (positions may span several cache blocks per tile, so any BLOCK_SIZE works):

    position p -> block_tables[seq, p // BLOCK_SIZE], slot p % BLOCK_SIZE

with an online softmax (running max m, running sum l, fp32 accumulator). A sliding window
starts the walk at position context_len - window (NO_WINDOW reaches back past position 0).
Attention sinks (GPT-OSS) start the softmax at m = sink, l = 1: a term exp(sink) in the
denominator with nothing added to the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_decode_args
from kernels.decode_split import _combine_splits_kernel, combine_splits, num_context_splits
from kernels.triton_utils import NO_WINDOW, block_dim, compute_dtype, is_interpreted, launchable


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    partial_ptr,
    lse_ptr,
    query_ptr,
    kv_ptr,
    block_tables_ptr,
    context_lens_ptr,
    sinks_ptr,
    scale,
    window,
    softcap,
    stride_query_seq,
    stride_query_head,
    stride_query_dim,
    stride_out_seq,
    stride_out_head,
    stride_out_dim,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_kv_dim,
    stride_table_seq,
    stride_table_block,
    stride_partial_seq,
    stride_partial_head,
    stride_partial_split,
    stride_partial_dim,
    stride_lse_seq,
    stride_lse_head,
    stride_lse_split,
    NUM_SPLITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP_SIZE
    mask_d = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP_SIZE + offs_g  # [BLOCK_G]

    q_mask = mask_g[:, None] & mask_d[None, :]  # [BLOCK_G, BLOCK_D]
    q = tl.load(
        query_ptr
        + seq * stride_query_seq
        + q_heads[:, None] * stride_query_head
        + offs_d[None, :] * stride_query_dim,
        mask=q_mask,
        other=0.0,
    ).to(COMPUTE_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if SINKS:  # each head's sink starts split 0's softmax: a term exp(sink) with no value
        sink = tl.load(sinks_ptr + q_heads, mask=mask_g, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    lo = tl.maximum(context_len - window, 0)  # the first position in the window
    # this split's positions [split_lo, split_hi), whole tiles of the walk; may be empty
    split_len = tl.cdiv(tl.cdiv(context_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_lo = lo + split * split_len
    split_hi = tl.minimum(split_lo + split_len, context_len)
    for start in range(split_lo, split_hi, BLOCK_N):
        positions = start + offs_n  # [BLOCK_N]
        mask_n = positions < context_len
        blocks = tl.load(
            table_row + (positions // BLOCK_SIZE) * stride_table_block, mask=mask_n, other=0
        ).to(tl.int64)
        rows = (
            blocks * stride_kv_block
            + (positions % BLOCK_SIZE) * stride_kv_slot
            + kv_head * stride_kv_head
        )  # [BLOCK_N] offsets of each position's K row
        kv_offsets = rows[:, None] + offs_d[None, :] * stride_kv_dim  # [BLOCK_N, BLOCK_D]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(kv_ptr + kv_offsets, mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(kv_ptr + stride_kv_kv + kv_offsets, mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [G, N]
        if SOFTCAP:  # Gemma 2: softcap * tanh(scores / softcap), tanh by exp (no overflow)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        # Position `start` is always in [lo, context_len), so every row has a finite max here.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]  # [BLOCK_G, BLOCK_D]
        tl.store(
            out_ptr
            + seq * stride_out_seq
            + q_heads[:, None] * stride_out_head
            + offs_d[None, :] * stride_out_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        # an empty split leaves l_i = 0: its partial is 0 and its lse -inf (weight 0)
        is_empty = l_i == 0.0  # [BLOCK_G]
        partial = acc / tl.where(is_empty, 1.0, l_i)[:, None]  # [BLOCK_G, BLOCK_D]
        # log of 1, not of 0, where empty: the where picks -inf there anyway
        lse = tl.where(is_empty, float("-inf"), m_i + tl.log(tl.where(is_empty, 1.0, l_i)))
        tl.store(
            partial_ptr
            + seq * stride_partial_seq
            + q_heads[:, None] * stride_partial_head
            + split * stride_partial_split
            + offs_d[None, :] * stride_partial_dim,
            partial,
            mask=q_mask,
        )
        tl.store(
            lse_ptr + seq * stride_lse_seq + q_heads * stride_lse_head + split * stride_lse_split,
            lse,
            mask=mask_g,
        )


def default_block_n(head_dim: int) -> int:
    """The context tile: 128 positions up to head_dim 128, else 64. On an H200, in a CUDA
    graph, 32 sequences x 2,048 positions (bench_gpu.py --sweep, docs/benchmarks.md): 128 read
    Llama-3-8B's KV (8 heads of 128) at 94 % of the copy bandwidth against 80 % for 64, and
    SmolLM2's (3 of 64) in 31 us against 50. A 128 x 256 tile of K and one of V, pipelined
    three deep, would pass the SM's shared memory, so head_dim 256 (Gemma) keeps 64."""
    return 128 if head_dim <= 128 else 64


def paged_decode_attention_triton(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton path of `backends.AttentionKernels.decode`; `block_n` is the context tile (None:
    `default_block_n`), and `num_warps` and `num_stages` the launch's (None: Triton's
    defaults, 4 and 3; bench_gpu.py --sweep times the choices on a card).
    A window starts the walk at the context's last `window` positions. `num_splits`: chunks
    each context is split into, one program each (None: `num_context_splits` of the shapes,
    device and `max_context_len`, a host-side bound on context_lens, or None; 1: no split, no
    scratch, no combine). `sinks`: [num_q_heads] float32 (GPT-OSS), folded into split 0's
    softmax, so the combine counts each once."""
    check_decode_args(query, kv_layer, block_tables, context_lens, scale)
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_layer.shape[3]
    group_size = num_q_heads // num_kv_heads
    out = torch.empty_like(query)  # [num_seqs, num_q_heads, head_dim]
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = num_context_splits(num_seqs, num_kv_heads, query.device, window,
                                        max_context_len)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # scratch sized by shapes only (CUDA graphs); unused, and 1-element, without a split
    scratch = (num_seqs, num_q_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    partial = query.new_empty((*scratch, head_dim), dtype=torch.float32)  # [S, Hq, splits, D]
    lse = query.new_empty(scratch, dtype=torch.float32)  # [S, Hq, splits]
    kernel = launchable(_paged_decode_kernel, query.device)
    tile_dtype, precision = compute_dtype(query.dtype, is_interpreted(kernel))
    kernel[(num_seqs, num_kv_heads, num_splits)](
        out,
        partial,
        lse,
        query,
        kv_layer,
        block_tables,
        context_lens,
        context_lens if sinks is None else sinks,
        float(scale),
        NO_WINDOW if window is None else int(window),
        float(softcap or 0.0),
        *query.stride(),
        *out.stride(),
        *kv_layer.stride(),
        *block_tables.stride(),
        *partial.stride(),
        *lse.stride(),
        NUM_SPLITS=num_splits,
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_layer.shape[2],
        BLOCK_G=block_dim(group_size),
        BLOCK_D=block_dim(head_dim),
        BLOCK_N=max(16, triton.next_power_of_2(block_n or default_block_n(head_dim))),
        COMPUTE_DTYPE=tile_dtype,
        DOT_PRECISION=precision,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
           if v is not None},
    )
    if num_splits > 1:
        combine_splits(out, partial, lse, launchable(_combine_splits_kernel, query.device))
    return out
