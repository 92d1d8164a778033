"""The fast torch path of every kernel: what runs on CPU. No Python loop over sequences.

Each attention call does one gather and one SDPA:

    kv_layer as rows: [num_blocks * 2 * block_size, H, D]     row = (block * 2 + kv) * block_size + slot
    rows of (seq s, position p) = T[s, p // block_size] * 2 * block_size + p % block_size  (K)
                                  ... + block_size                                          (V)
    one index_select of [2, num_seqs, max_len] rows -> K, V: [num_seqs, max_len, H, D]

then `scaled_dot_product_attention` over the padded batch (in groups of sequences when the
gather would exceed MAX_GATHER_BYTES). Measured on 2 cores while choosing: this beat gathering
whole blocks then reshaping (two copies), and SDPA beat explicit fp32 matmuls and einsum, for
both fp32 and bf16 (SDPA accumulates bf16 in fp32). benchmarks/bench_kernels.py times it.

Invariant relied on: every cache slot holds a finite value (the cache is allocated with zeros),
because padded positions are masked in the softmax but still multiplied by zero probabilities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import check_decode_args, check_prefill_args, check_store_kv_args

# Batches whose gathered K/V would exceed this are processed in groups of sequences. Measured:
# fp32 decode 64 seqs x 512 tokens (50 MB) takes ~22 ms on 2 cores in groups against ~39 ms
# in one gather, because a buffer below glibc's mmap threshold (≤ 32 MB) is reused from the
# heap instead of being page-faulted in on every call; smaller batches are a single group.
MAX_GATHER_BYTES = 16 << 20
DECODE_CHUNK = 64  # decode attention pads each sequence's keys to a multiple of this (_decode)


def _flat_rows(kv_layer: torch.Tensor) -> torch.Tensor | None:
    """kv_layer viewed as [num_blocks * 2 * block_size, H, D] rows, or None if not a view.

    It is a view whenever (block, kv, slot) are laid out as in layout.py, including a layer
    view `kv_cache[layer]` of the contiguous whole-cache tensor.
    """
    num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
    try:
        return kv_layer.view(-1, num_kv_heads, head_dim)  # [num_blocks * 2 * block_size, H, D]
    except RuntimeError:
        return None


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    step_cache: dict | None = None,
) -> None:
    """Torch path of `backends.AttentionKernels.store_kv`: two `index_copy_` into the cache's row view.

    step_cache: a dict that lives for one model step; index arithmetic that is the same in every
    layer is done in the first layer and reused from it.
    """
    check_store_kv_args(key, value, kv_layer, slot_mapping)
    flat = _flat_rows(kv_layer)
    cached = step_cache.get("store") if step_cache is not None else None
    if cached is None:
        is_real = slot_mapping >= 0  # [num_tokens]; -1 marks padding
        real = None if bool(is_real.all()) else is_real
        if real is not None:
            slot_mapping = slot_mapping[real]
        block_size = kv_layer.shape[2]
        slots = slot_mapping.long()
        blocks, offsets = slots // block_size, slots % block_size  # [num_real_tokens]
        key_rows = blocks * (2 * block_size) + offsets  # [num_real_tokens]
        cached = (real, blocks, offsets, key_rows, key_rows + block_size)
        if step_cache is not None:
            step_cache["store"] = cached
    real, blocks, offsets, key_rows, value_rows = cached
    if real is not None:
        key, value = key[real], value[real]
    if flat is None:
        kv_layer[:, 0][blocks, offsets] = key  # index_put_ through views writes the cache
        kv_layer[:, 1][blocks, offsets] = value
        return
    flat.index_copy_(0, key_rows, key)
    flat.index_copy_(0, value_rows, value)


def gather_kv(
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    rows_cache: dict | None = None,
    cache_key: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..max_len-1 of every sequence, each [num_seqs, H, max_len, D].

    Positions at or past seq_lens[s] read row 0 (block table tails may hold any value); the
    caller masks them. rows_cache[cache_key] keeps the row indices for the next layer.
    """
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads, head_dim = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    flat = _flat_rows(kv_layer)
    rows = rows_cache.get(cache_key) if rows_cache is not None and flat is not None else None
    if rows is not None:
        kv = flat.index_select(0, rows)  # [2 * num_seqs * max_len, H, D]
        kv = kv.view(2, num_seqs, max_len, num_kv_heads, head_dim)
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    positions = torch.arange(max_len, device=kv_layer.device)  # [max_len]
    columns = (positions // block_size).clamp_max(block_tables.shape[1] - 1)  # padding past
    blocks = block_tables[:, columns].long()  # [num_seqs, max_len]     the table reads its end
    blocks = torch.where(positions < seq_lens[:, None], blocks, 0)  # [num_seqs, max_len]
    offsets = positions % block_size  # [max_len]
    if flat is None:
        key = kv_layer[:, 0][blocks, offsets]  # [num_seqs, max_len, H, D]
        value = kv_layer[:, 1][blocks, offsets]  # [num_seqs, max_len, H, D]
        return key.transpose(1, 2), value.transpose(1, 2)
    key_rows = blocks * (2 * block_size) + offsets  # [num_seqs, max_len]
    rows = torch.stack((key_rows, key_rows + block_size)).view(-1)  # [2 * num_seqs * max_len]
    if rows_cache is not None:
        rows_cache[cache_key] = rows
    kv = flat.index_select(0, rows)  # [2 * num_seqs * max_len, H, D]
    kv = kv.view(2, num_seqs, max_len, num_kv_heads, head_dim)  # [2, num_seqs, max_len, H, D]
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [num_seqs, H, max_len, D] each


def sequence_chunks(num_seqs: int, bytes_per_seq: int) -> list[tuple[int, int]]:
    """[start, end) groups of sequences whose gathered K/V stay within MAX_GATHER_BYTES."""
    per_chunk = max(1, MAX_GATHER_BYTES // max(1, bytes_per_seq))
    return [(s, min(num_seqs, s + per_chunk)) for s in range(0, num_seqs, per_chunk)]


def _gather_bytes(kv_layer: torch.Tensor, max_len: int) -> int:
    """Bytes of one sequence's gathered K and V."""
    return 2 * max_len * kv_layer.shape[3] * kv_layer.shape[4] * kv_layer.element_size()


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, attn_mask: torch.Tensor,
           scale: float, enable_gqa: bool = False, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., heads, rows, D] with a boolean mask. With a soft cap (Gemma 2: each
    scaled score becomes softcap * tanh(score / softcap) before the mask and softmax) or
    sinks (GPT-OSS: a logit per query head that joins each softmax's denominator and has no
    value; shaped to broadcast against the scores' [..., heads, rows, 1]), which SDPA cannot
    apply, the same math written out in float32."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, key, value, attn_mask=attn_mask, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa:  # query head h reads KV head h // group, as SDPA's enable_gqa does
        group = q.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    scores = (q.float() @ key.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(dim=-1) @ value.float()).to(q.dtype)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ value.float()).to(q.dtype)


def paged_decode_attention_torch(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    step_cache: dict | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch path of `backends.AttentionKernels.decode` (see `_decode` for the method).

    step_cache: see `store_kv_torch`; the gather rows and mask are computed once per step.
    """
    check_decode_args(query, kv_layer, block_tables, context_lens, scale)
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return torch.empty_like(query)
    chunks = step_cache.get("decode_chunks") if step_cache is not None else None
    if chunks is None:
        chunks = sequence_chunks(num_seqs, _gather_bytes(kv_layer, int(context_lens.max())))
        if step_cache is not None:
            step_cache["decode_chunks"] = chunks
    if len(chunks) == 1:
        return _decode(query, kv_layer, block_tables, context_lens, scale, step_cache, 0, window,
                       softcap, sinks)
    out = torch.empty_like(query)  # [num_seqs, num_q_heads, head_dim]
    for start, end in chunks:
        out[start:end] = _decode(
            query[start:end], kv_layer, block_tables[start:end], context_lens[start:end], scale,
            step_cache, start, window, softcap, sinks,
        )
    return out


def _decode(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    step_cache: dict | None = None,
    group_start: int = 0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of a group of sequences, batch invariant: a sequence's output is bit
    for bit the same whatever else shares the step (continuous batching must not change a
    greedy token).

    SDPA's float sums regroup with the padded key length, so one SDPA over the batch padded
    to its longest context would make a sequence's result depend on its neighbours. Instead
    each sequence is padded to its own length rounded up to DECODE_CHUNK keys, and sequences
    of the same padded length share one gather and one masked SDPA (a few calls per step, not
    one per sequence). Exact on one intra-op thread, as every worker runs: torch 2.13's CPU
    SDPA rounds differently on its worker threads than on the calling one, so with more
    threads a row's result depends on which thread its batch position lands on (measured;
    the difference is ~1e-7). GQA without repeating K/V: the `group` query heads sharing a KV head
    are presented to SDPA as `group` query rows of that head (measured fastest, notably in
    bf16).
    """
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_layer.shape[3]
    group = num_q_heads // num_kv_heads
    key = ("decode", group_start, window)  # layers of different windows share the step
    plan = step_cache.get(key) if step_cache is not None else None
    if plan is None:
        plan = _decode_plan(block_tables, context_lens, window)
        if step_cache is not None:
            step_cache[key] = plan
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim)  # [S, H, group, D]
    if sinks is not None:  # query head h * group + g is row g of KV head h
        sinks = sinks.reshape(num_kv_heads, group, 1)
    out = q if len(plan) == 1 else torch.empty_like(q)
    for padded, index, tables, lens, mask in plan:
        key, value = gather_kv(kv_layer, tables, lens, padded, step_cache,
                               ("decode_rows", group_start, padded))  # [s, H, L, D] each
        part = attend(q if index is None else q[index], key, value, attn_mask=mask,
                      scale=scale, softcap=softcap, sinks=sinks)
        if index is None:
            out = part
        else:
            out[index] = part
    return out.reshape(num_seqs, num_q_heads, head_dim)  # [S, num_q_heads, D]


def _decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor,
                 window: int | None = None) -> list[tuple]:
    """(padded length, sequence indices or None for all, their block tables, context lengths,
    key mask [s, 1, 1, padded]) for each padded length present. A window masks the keys
    before the context's last `window` (they are gathered all the same)."""
    padded_lens = (context_lens + DECODE_CHUNK - 1) // DECODE_CHUNK * DECODE_CHUNK
    lengths = padded_lens.unique().tolist()
    plan = []
    for padded in lengths:
        index, tables, lens = None, block_tables, context_lens  # one length: every sequence
        if len(lengths) > 1:
            index = torch.nonzero(padded_lens == padded).squeeze(1)
            tables, lens = block_tables[index], context_lens[index]
        positions = torch.arange(padded, device=context_lens.device)
        mask = positions < lens[:, None]  # [s, padded]
        if window is not None:
            mask &= positions >= lens[:, None] - window
        mask = mask[:, None, None, :]  # [s, 1, 1, padded]
        plan.append((padded, index, tables, lens, mask))
    return plan


def paged_prefill_attention_torch(
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
    """Torch path of `backends.AttentionKernels.prefill` (see `_prefill` for the method)."""
    check_prefill_args(query, kv_layer, block_tables, query_start_loc, seq_lens, scale)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    chunks = sequence_chunks(num_seqs, _gather_bytes(kv_layer, int(seq_lens.max())))
    if len(chunks) == 1:
        return _prefill(query, kv_layer, block_tables, query_start_loc, seq_lens, scale, window,
                        softcap, sinks)
    out = torch.empty_like(query)  # [num_tokens, num_q_heads, head_dim]
    token_starts = query_start_loc.tolist()  # a chunk's tokens are contiguous in query
    for start, end in chunks:
        first, last = token_starts[start], token_starts[end]
        out[first:last] = _prefill(
            query[first:last],
            kv_layer,
            block_tables[start:end],
            query_start_loc[start : end + 1] - first,
            seq_lens[start:end],
            scale,
            window,
            softcap,
            sinks,
        )
    return out


def _prefill(
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
    """Prefill attention of a group of sequences with one gather and one SDPA.

    The new tokens are padded to [num_seqs, max_q_len] with one index gather. When no
    sequence has a cached prefix, padded rows are harmless under SDPA's top-left `is_causal`
    (a real row i only sees keys ≤ i < q_len) and the flash kernel skips the masked half;
    otherwise (or with a sliding window) an explicit mask allows key j for query i iff
    prefix_len + i - window < j ≤ prefix_len + i. query_start_loc[0] must be 0.
    """
    num_q_heads = query.shape[1]
    num_seqs = seq_lens.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    prefix_lens = seq_lens - query_lens  # [S]
    max_q_len, max_len = int(query_lens.max()), int(seq_lens.max())
    key, value = gather_kv(kv_layer, block_tables, seq_lens, max_len)  # [S, H, L, D]

    steps = torch.arange(max_q_len, device=query.device)  # [max_q_len]
    is_token = steps < query_lens[:, None]  # [S, max_q_len]
    if num_seqs == 1:
        q = query[None]  # [1, T, num_q_heads, D]
    else:
        token_ids = torch.where(is_token, query_start_loc[:-1, None].long() + steps, 0)
        q = query[token_ids]  # [S, max_q_len, num_q_heads, D]
    q = q.transpose(1, 2)  # [S, num_q_heads, max_q_len, D]

    is_gqa = num_q_heads != kv_layer.shape[3]
    if window is None and softcap is None and sinks is None and not bool(prefix_lens.any()):
        out = F.scaled_dot_product_attention(
            q, key, value, is_causal=True, scale=scale, enable_gqa=is_gqa
        )
    else:
        key_positions = torch.arange(max_len, device=query.device)  # [L]
        query_positions = prefix_lens[:, None] + steps  # [S, max_q_len]
        mask = key_positions <= query_positions[:, :, None]  # [S, max_q_len, L]
        if window is not None:
            mask &= key_positions > query_positions[:, :, None] - window
        out = attend(q, key, value, attn_mask=mask[:, None], scale=scale, enable_gqa=is_gqa,
                     softcap=softcap, sinks=None if sinks is None else sinks[:, None, None])
    out = out.transpose(1, 2)  # [S, max_q_len, num_q_heads, D]
    if num_seqs == 1:
        return out[0].contiguous()  # [T, num_q_heads, D]
    return out[is_token]  # [T, num_q_heads, D], sequences in order
