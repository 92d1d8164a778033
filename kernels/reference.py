"""Torch references of the kernels: slow, simple, obviously correct. Tests compare against these.

Every loop here walks sequences or tokens one at a time and reads the cache exactly as
layout.py describes it: token p of a sequence lives in block T[p // block_size], slot
p % block_size. Attention is computed in fp32 from first principles (no SDPA).
"""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token i's K/V into flat slot slot_mapping[i]; a slot of -1 is skipped."""
    block_size = kv_layer.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_layer[slot // block_size, 0, slot % block_size] = key[i]
        kv_layer[slot // block_size, 1, slot % block_size] = value[i]


def gather_seq_kv_ref(
    kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..seq_len-1 of one sequence, each [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_layer.shape[2]
    keys, values = [], []
    for pos in range(seq_len):
        block = int(block_table[pos // block_size])
        keys.append(kv_layer[block, 0, pos % block_size])  # [num_kv_heads, head_dim]
        values.append(kv_layer[block, 1, pos % block_size])
    return torch.stack(keys), torch.stack(values)


def attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence in fp32 (with a window: over the last `window`
    positions up to the query's own; with a soft cap, scores softcap * tanh(s / softcap);
    with sinks, [num_q_heads] logits, each head's softmax over its scores and its sink, whose
    probability is dropped: GPT-OSS's attention sinks).

    query: [q_len, num_q_heads, head_dim]; key, value: [kv_len, num_kv_heads, head_dim];
    query_positions: [q_len] absolute positions; query i attends to keys 0..query_positions[i].
    Returns [q_len, num_q_heads, head_dim] in query's dtype.
    """
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)  # [kv_len, num_q_heads, head_dim]
    v = value.float().repeat_interleave(group, dim=1)  # [kv_len, num_q_heads, head_dim]
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale  # [heads, q_len, kv_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    kv_positions = torch.arange(key.shape[0])
    allowed = kv_positions[None, :] <= query_positions[:, None]  # [q_len, kv_len]
    if window is not None:
        allowed &= kv_positions[None, :] > query_positions[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(*scores.shape[:2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v)  # [q_len, num_q_heads, head_dim]
    return out.to(query.dtype)


def paged_decode_attention_ref(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its context_lens[s] cached tokens."""
    out = torch.empty_like(query)
    for s in range(query.shape[0]):
        context_len = int(context_lens[s])
        key, value = gather_seq_kv_ref(kv_layer, block_tables[s], context_len)
        position = torch.tensor([context_len - 1])
        out[s] = attention_ref(query[s : s + 1], key, value, position, scale, window,
                               softcap, sinks)[0]
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal prefill over a cached prefix (see backends.AttentionKernels)."""
    out = torch.empty_like(query)
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len = int(seq_lens[s])
        key, value = gather_seq_kv_ref(kv_layer, block_tables[s], seq_len)
        positions = torch.arange(seq_len - (end - start), seq_len)
        out[start:end] = attention_ref(query[start:end], key, value, positions, scale, window,
                                       softcap, sinks)
    return out
