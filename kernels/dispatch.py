"""The public kernel API: picks the backend per call and forwards.

    CUDA tensors -> Triton kernels            (kernels/store_kv_triton.py, *_attention.py)
    CPU tensors  -> the fast torch path       (kernels/cpu_attention.py)

PDSERVE_ATTN_BACKEND=triton|torch forces one (read on every call); kernels/backends.py holds
the whole backend matrix, the CPU's C kernels included. The tests use
`triton` together with TRITON_INTERPRET=1 to run the Triton kernels on CPU tensors. Triton
modules are imported lazily, so the torch path never pays for (or needs) importing triton.
"""

from __future__ import annotations

import torch

from kernels import cpu_attention
from kernels.backends import BACKEND_ENV, per_call_backend  # noqa: F401 (BACKEND_ENV: re-export)


def select_backend(device: torch.device) -> str:
    """ "triton" or "torch" for tensors on `device`, honouring PDSERVE_ATTN_BACKEND
    (kernels/backends.py holds the whole matrix)."""
    return per_call_backend(device)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    step_cache: dict | None = None,
) -> None:
    """Write new tokens' K/V into one layer of the paged cache, in place.

    key, value: [num_tokens, num_kv_heads, head_dim]; kv_layer: [num_blocks, 2, block_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens] flat slot ids
    (block * block_size + offset), -1 = padding token, skipped. Slots must be unique and
    < num_blocks * block_size. step_cache: an empty dict per model step, shared by the layers'
    calls, lets the torch path compute its index arithmetic once per step (Triton ignores it).
    """
    if select_backend(kv_layer.device) == "triton":
        from kernels.store_kv_triton import store_kv_triton

        store_kv_triton(key, value, kv_layer, slot_mapping)
    else:
        cpu_attention.store_kv_torch(key, value, kv_layer, slot_mapping, step_cache)


def paged_decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    step_cache: dict | None = None,
    window: int | None = None,
    *,
    max_context_len: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached K/V (its own K/V included).

    query: [num_seqs, num_q_heads, head_dim]; kv_layer as in `store_kv`; block_tables:
    [num_seqs, max_blocks_per_seq] int32 (entries past a sequence's blocks may hold anything);
    context_lens: [num_seqs] int32, ≥ 1, KV tokens to attend to. GQA: query head h reads KV
    head h // (num_q_heads // num_kv_heads). Softmax in fp32. Returns
    [num_seqs, num_q_heads, head_dim] in query's dtype. step_cache: as in `store_kv`.
    window: a sliding window, the last `window` tokens of each context (None: all of them).
    max_context_len: a host-side bound on context_lens (None: unknown), with which the Triton
    kernel splits short contexts less (kernels/decode_split.py); a bound, so a CUDA graph may
    be captured with a larger one than its replays see. softcap: each scaled score becomes
    softcap * tanh(score / softcap) before the softmax (Gemma 2; None: no cap). sinks:
    [num_q_heads] float32 logits, each head's attention sink (GPT-OSS): exp(sink) joins the
    softmax's denominator, with no value (None: no sinks).
    """
    if select_backend(query.device) == "triton":
        from kernels.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(query, kv_layer, block_tables, context_lens, scale,
                                             window, max_context_len=max_context_len,
                                             softcap=softcap, sinks=sinks)
    return cpu_attention.paged_decode_attention_torch(
        query, kv_layer, block_tables, context_lens, scale, step_cache, window, softcap, sinks
    )


def paged_prefill_attention(
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
) -> torch.Tensor:
    """Varlen causal attention of new tokens over a cached prefix (all K/V already stored).

    query: [num_tokens, num_q_heads, head_dim], the new tokens of num_seqs sequences
    concatenated; query_start_loc: [num_seqs + 1] int32 offsets into query; seq_lens:
    [num_seqs] int32 KV length after this step (prefix + new). Token i of sequence s, with
    q_len = query_start_loc[s + 1] - query_start_loc[s], sits at position
    seq_lens[s] - q_len + i and attends to positions 0..that position, or with a `window`
    to the last `window` of them (position - window < key position <= position). Returns
    [num_tokens, num_q_heads, head_dim] in query's dtype. max_query_len: the longest q_len,
    known on the host (None: the Triton path reads it from the device, a sync). softcap and
    sinks: as in `paged_decode_attention`.
    """
    if select_backend(query.device) == "triton":
        from kernels.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            query, kv_layer, block_tables, query_start_loc, seq_lens, scale, window,
            max_query_len=max_query_len, softcap=softcap, sinks=sinks,
        )
    return cpu_attention.paged_prefill_attention_torch(
        query, kv_layer, block_tables, query_start_loc, seq_lens, scale, window, softcap, sinks
    )
