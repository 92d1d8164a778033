"""Triton paged prefill attention: varlen causal attention of new tokens over a cached prefix.

Grid: (num_seqs, num_q_heads, cdiv(max_q_len, BLOCK_M)). A program owns BLOCK_M consecutive
new tokens of one sequence and one query head. Its tokens sit at absolute positions

    prefix_len + i,   prefix_len = seq_len - q_len,   i in [m_start, m_start + BLOCK_M)

and attend to positions 0..prefix_len + i, all of which are already in the cache. K/V tiles of
BLOCK_N positions are read through the block table as in the decode kernel; the loop stops at
the last position any of the program's tokens can see. With a sliding window a token sees
positions (its position - window, its position], and the loop starts at the first position the
program's first token can see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_prefill_args
from kernels.triton_utils import NO_WINDOW, block_dim, compute_dtype, is_interpreted, launchable


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    query_ptr,
    kv_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    scale,
    window,
    softcap,
    stride_query_token,
    stride_query_head,
    stride_query_dim,
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_kv_dim,
    stride_table_seq,
    stride_table_block,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    m_start = tl.program_id(2) * BLOCK_M
    token_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - token_start
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    prefix_len = seq_len - q_len
    kv_head = head // GROUP_SIZE

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] token index within the sequence
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_mask = mask_m[:, None] & mask_d[None, :]  # [BLOCK_M, BLOCK_D]
    q = tl.load(
        query_ptr
        + (token_start + offs_m)[:, None] * stride_query_token
        + head * stride_query_head
        + offs_d[None, :] * stride_query_dim,
        mask=q_mask,
        other=0.0,
    ).to(COMPUTE_DTYPE)
    # Rows past q_len get positions ≥ seq_len; they are computed but never stored.
    q_positions = prefix_len + offs_m  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:  # the head's sink starts the softmax: a term exp(sink) with no value (GPT-OSS)
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    kv_end = tl.minimum(seq_len, prefix_len + m_start + BLOCK_M)  # last visible position + 1
    kv_start = tl.maximum(prefix_len + m_start - window + 1, 0)  # first one, for row m_start
    for start in range(kv_start, kv_end, BLOCK_N):
        positions = start + offs_n  # [BLOCK_N]
        mask_n = positions < kv_end
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

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, N]
        if SOFTCAP:  # Gemma 2: softcap * tanh(scores / softcap), tanh by exp (no overflow)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        visible = mask_n[None, :] & (positions[None, :] <= q_positions[:, None])  # [M, N]
        visible &= positions[None, :] > q_positions[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        # With a window a row may see nothing in a tile (the first ones for later rows): its
        # max stays -inf and is shifted by 0 instead, so it adds exp(-inf) = 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(scores - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
    tl.store(
        out_ptr
        + (token_start + offs_m)[:, None] * stride_out_token
        + head * stride_out_head
        + offs_d[None, :] * stride_out_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill_attention_triton(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    max_query_len: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton path of `backends.AttentionKernels.prefill`; `block_m`/`block_n` are the tiles.

    The grid is sized by max(q_len): `max_query_len` where the caller knows it on the host,
    else read from the device (one sync per call). `sinks`: [num_q_heads] float32 (GPT-OSS).
    """
    check_prefill_args(query, kv_layer, block_tables, query_start_loc, seq_lens, scale)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)  # [num_tokens, num_q_heads, head_dim]
    if num_tokens == 0:
        return out
    max_q_len = (max_query_len if max_query_len is not None
                 else int((query_start_loc[1:] - query_start_loc[:-1]).max()))
    block_m = max(16, triton.next_power_of_2(block_m))
    kernel = launchable(_paged_prefill_kernel, query.device)
    tile_dtype, precision = compute_dtype(query.dtype, is_interpreted(kernel))
    kernel[(num_seqs, num_q_heads, triton.cdiv(max_q_len, block_m))](
        out,
        query,
        kv_layer,
        block_tables,
        query_start_loc,
        seq_lens,
        seq_lens if sinks is None else sinks,
        float(scale),
        NO_WINDOW if window is None else int(window),
        float(softcap or 0.0),
        *query.stride(),
        *out.stride(),
        *kv_layer.stride(),
        *block_tables.stride(),
        GROUP_SIZE=num_q_heads // kv_layer.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_layer.shape[2],
        BLOCK_M=block_m,
        BLOCK_D=block_dim(head_dim),
        BLOCK_N=max(16, triton.next_power_of_2(block_n)),
        COMPUTE_DTYPE=tile_dtype,
        DOT_PRECISION=precision,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
    )
    return out
