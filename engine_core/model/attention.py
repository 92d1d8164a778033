"""Paged attention as the model sees it: store this step's K/V, then attend over the cache.

A step's tokens are flattened into one batch, decode sequences first:

    tokens: [ d0 d1 d2 | p0 p0 p0 p0 p1 p1 ]   num_decode_tokens = 3
              one per     prefill chunks (varlen),
              decode seq  each after its cached prefix
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_core.model.ops import ModelOps


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV slot of each new token
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, KV length incl. the new token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets after decodes
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, KV length after this step
    # decode_context_lens.max() or a bound on it (a CUDA graph's: max_model_len), for kernels
    # that size scratch or split contexts by it; 0: unknown
    decode_max_len: int = 0
    # the prefill rows one by one, for kernels that attend row by row (the native CPU kernel):
    # each row's index into prefill_block_tables and its KV length (position + 1). The model
    # runner passes them, computed on the host with prefill_max_len (so no step reads a device
    # tensor back); left None, they are derived here from the fields above.
    prefill_row_tables: torch.Tensor | None = None  # [num_prefill_tokens] int32
    prefill_row_lens: torch.Tensor | None = None  # [num_prefill_tokens] int32
    prefill_max_len: int | None = None  # prefill_seq_lens.max(), 0 without prefills
    # the longest prefill chunk (query rows of one sequence), from the host: sizes the Triton
    # prefill kernel's grid without reading the device back; None: the kernel reads it
    prefill_max_query_len: int | None = None
    # the rows are the step's prefill rows only: its decode rows ran elsewhere (the C layers)
    decodes_done: bool = False
    # index arithmetic the CPU kernels share between layers; lives for one step
    kernel_cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prefill_row_tables is not None:
            assert self.prefill_row_lens is not None and self.prefill_max_len is not None
            return
        qsl, seq_lens = self.prefill_query_start_loc, self.prefill_seq_lens
        if len(seq_lens) == 0:  # a decode-only step
            self.prefill_row_tables = self.prefill_row_lens = seq_lens
            self.prefill_max_len = 0
            return
        query_lens = qsl[1:] - qsl[:-1]  # [num_prefills]
        self.prefill_row_tables = torch.repeat_interleave(
            torch.arange(len(query_lens), dtype=torch.int32, device=qsl.device), query_lens)
        # a row's KV length: its sequence's length after the step, less the rows after it
        rows = torch.arange(int(qsl[-1]), device=qsl.device)
        ends = torch.repeat_interleave(seq_lens - qsl[1:], query_lens)  # seq_len - chunk end
        self.prefill_row_lens = (rows + ends + 1).to(torch.int32)
        self.prefill_max_len = int(seq_lens.max())

    @property
    def num_prefills(self) -> int:
        return self.prefill_seq_lens.shape[0]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    ops: ModelOps,
    skip_decodes: int = 0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """ops: the platform's kernels (ops.py). skip_decodes: the step's decode rows were done elsewhere (the native CPU kernel) and
    q/k/v are its prefill rows only; 0 or meta.num_decode_tokens.
    window: each token attends to the last `window` positions, itself included (None: all).
    softcap: scores capped to softcap * tanh(score / softcap) before the softmax (Gemma 2).
    sinks: [num_heads] float32, each head's sink logit in its softmax (GPT-OSS; None: none)."""
    if skip_decodes:
        cache = meta.kernel_cache.setdefault("prefill_rows", {})
        ops.store_kv(k, v, kv_layer, meta.slot_mapping[skip_decodes:], cache)
        return ops.prefill_attention(
            q, kv_layer, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_seq_lens, scale, window, max_query_len=meta.prefill_max_query_len,
            softcap=softcap, sinks=sinks,
        )
    ops.store_kv(k, v, kv_layer, meta.slot_mapping, meta.kernel_cache)
    nd = meta.num_decode_tokens
    if meta.num_prefills == 0:
        return ops.decode_attention(
            q, kv_layer, meta.decode_block_tables, meta.decode_context_lens, scale,
            meta.kernel_cache, window, max_context_len=meta.decode_max_len or None,
            softcap=softcap, sinks=sinks,
        )
    prefill_out = ops.prefill_attention(
        q[nd:], kv_layer, meta.prefill_block_tables, meta.prefill_query_start_loc,
        meta.prefill_seq_lens, scale, window, max_query_len=meta.prefill_max_query_len,
        softcap=softcap, sinks=sinks,
    )
    if nd == 0:
        return prefill_out
    decode_out = ops.decode_attention(
        q[:nd], kv_layer, meta.decode_block_tables, meta.decode_context_lens, scale,
        meta.kernel_cache, window, max_context_len=meta.decode_max_len or None,
        softcap=softcap, sinks=sinks,
    )
    return torch.cat([decode_out, prefill_out], dim=0)
