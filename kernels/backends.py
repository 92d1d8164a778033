"""Which kernels compute attention: the one selection, and the kernels it names.

| device | default | `PDSERVE_ATTN_BACKEND=` |
| --- | --- | --- |
| CUDA | `triton`: kernels/decode_attention.py, prefill_attention.py, store_kv_triton.py | `torch` |
| CPU | `native`: the C kernels (kernels/csrc, loaded by kernels/native.py) attend row by row, rope and K/V store included; `torch` where they do not load | `torch`; `triton` (only with `TRITON_INTERPRET=1`, the tests' way to run the Triton kernels on CPU) |

The C library loads unless `PDSERVE_NATIVE=0`, there is no C compiler and no prebuilt
library (`PDSERVE_NATIVE_DIR`), or the CPU lacks AVX2/FMA; `PDSERVE_NATIVE=avx2|avx512`
picks a narrower build. The engine's platform (engine_core/platforms/) calls
`select_backend` once, at construction, and passes the `AttentionKernels` it names to the
model it builds; nothing decides per call. The decode rows' 4/8-bit matmuls are the CPU
platform's too: engine_core/platforms/cpu/decode_quant.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu_attention, native

logger = logging.getLogger(__name__)

BACKEND_ENV = "PDSERVE_ATTN_BACKEND"
ATTENTION_BACKENDS = ("native", "triton", "torch")


@dataclass(frozen=True)
class AttentionKernels:
    """One backend's paged-attention kernels (signatures: kernels/cpu_attention.py's torch
    path, which every backend shares):

    store_kv(key, value, kv_layer, slot_mapping, step_cache)
    decode(query, kv_layer, block_tables, context_lens, scale, step_cache, window, *,
           max_context_len, softcap, sinks)
    prefill(query, kv_layer, block_tables, query_start_loc, seq_lens, scale, window, *,
            max_query_len, softcap, sinks)

    store_kv writes new tokens' K/V into one layer of the paged cache, in place: key, value
    [num_tokens, num_kv_heads, head_dim]; kv_layer [num_blocks, 2, block_size, num_kv_heads,
    head_dim]; slot_mapping [num_tokens] flat slot ids (block * block_size + offset), -1 a
    padding token, skipped. step_cache: an empty dict per model step, shared by the layers'
    calls, in which the torch path keeps its index arithmetic (Triton ignores it).

    decode attends one new token per sequence over its cached K/V (its own included): query
    [num_seqs, num_q_heads, head_dim]; block_tables [num_seqs, max_blocks] int32 (entries past
    a sequence's blocks may hold anything); context_lens [num_seqs] int32 >= 1. GQA: query
    head h reads KV head h // (num_q_heads // num_kv_heads); softmax in fp32; the result in
    query's dtype. window: the last `window` tokens only (None: all). max_context_len: a host
    bound on context_lens with which Triton splits short contexts less (decode_split.py).
    softcap: scores become softcap * tanh(score / softcap) (Gemma 2). sinks: [num_q_heads]
    float32 sink logits joining each softmax's denominator (GPT-OSS).

    prefill is varlen causal attention of new tokens over a cached prefix (all K/V stored):
    query [num_tokens, ...] of num_seqs sequences concatenated; query_start_loc
    [num_seqs + 1] int32 offsets; seq_lens [num_seqs] int32, KV length after the step. Token
    i of sequence s sits at position seq_lens[s] - q_len + i and attends to positions up to
    its own (or the last `window`). max_query_len: the longest chunk, known on the host (None:
    Triton reads it from the device, a sync).

    `lib` is the C library of the native backend (None elsewhere): its rows attend in C
    (kernels/native.py), rope and K/V store included; the torch kernels above take what it
    cannot (a cache that is not contiguous)."""

    name: str
    store_kv: Callable
    decode: Callable
    prefill: Callable
    lib: ctypes.CDLL | None = None


def forced_backend() -> str | None:
    """PDSERVE_ATTN_BACKEND, checked, or None when unset."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not forced:
        return None
    if forced not in ATTENTION_BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {ATTENTION_BACKENDS}, got {forced!r}")
    return forced


def select_backend(device: torch.device) -> str:
    """The backend a model on `device` attends with: "native", "triton" or "torch" (the
    environment's override, else the table above)."""
    forced = forced_backend()
    if forced == "native" and device.type != "cpu":
        raise ValueError(f"{BACKEND_ENV}=native is the CPU's C kernels; the device is {device}")
    if forced is not None:
        return forced
    if device.type == "cuda":
        return "triton"
    return "native" if native.load() is not None else "torch"


def attention_kernels(backend: str) -> AttentionKernels:
    """The kernels of `backend` (select_backend's answer). Triton's modules are imported here,
    on that backend only: the others never pay for (or need) triton."""
    if backend == "triton":
        from kernels.decode_attention import paged_decode_attention_triton
        from kernels.prefill_attention import paged_prefill_attention_triton
        from kernels.store_kv_triton import store_kv_triton

        def store(key, value, kv_layer, slot_mapping, step_cache=None):
            store_kv_triton(key, value, kv_layer, slot_mapping)

        def decode(query, kv_layer, block_tables, context_lens, scale, step_cache=None,
                   window=None, **kwargs):
            return paged_decode_attention_triton(query, kv_layer, block_tables, context_lens,
                                                 scale, window, **kwargs)

        def prefill(query, kv_layer, block_tables, query_start_loc, seq_lens, scale,
                    window=None, **kwargs):
            return paged_prefill_attention_triton(query, kv_layer, block_tables,
                                                  query_start_loc, seq_lens, scale, window,
                                                  **kwargs)

        return AttentionKernels("triton", store, decode, prefill)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, "
                         f"got {backend!r}")

    def decode(query, kv_layer, block_tables, context_lens, scale, step_cache=None,
               window=None, *, max_context_len=None, softcap=None, sinks=None):
        return cpu_attention.paged_decode_attention_torch(
            query, kv_layer, block_tables, context_lens, scale, step_cache, window, softcap,
            sinks)

    def prefill(query, kv_layer, block_tables, query_start_loc, seq_lens, scale, window=None,
                *, max_query_len=None, softcap=None, sinks=None):
        return cpu_attention.paged_prefill_attention_torch(
            query, kv_layer, block_tables, query_start_loc, seq_lens, scale, window, softcap,
            sinks)

    lib = native.load() if backend == "native" else None
    if backend == "native" and lib is None:
        raise ValueError(f"{BACKEND_ENV}=native: the C kernels did not load (PDSERVE_NATIVE, "
                         "a C compiler and an AVX2 CPU; see kernels/native.py)")
    return AttentionKernels(backend, cpu_attention.store_kv_torch, decode, prefill, lib)
