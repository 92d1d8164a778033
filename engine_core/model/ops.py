"""The kernels a model's modules call, chosen by the platform that builds the model
(engine_core/platforms/). The model imports no kernel: it is plain PyTorch over these
callables, so which hardware runs it is decided once, outside it (import-linter's
`model-imports-no-kernels` contract keeps it so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelOps:
    """store_kv, decode_attention, prefill_attention: the paged-attention kernels, with the
    signatures of kernels/backends.py's AttentionKernels (store this step's K/V; one new
    token per sequence over its cache; varlen prefill chunks over their prefix).

    row_attention(rows, cos_sin, kv_layer, slot_mapping, block_tables, row_lens, num_heads,
    scale, max_len, row_tables=None, window=None, softcap=None, sinks=None): rope, K/V store
    and attention of float32 qkv rows in one call, each row over its own context (the CPU's C
    kernels); None: rope in torch, then the three kernels above.

    rms_norm(x_or_residual, x_or_None, weight, eps): the fused (add +) RMSNorm the C kernels
    compute in place for a float32 model; None: torch's.

    grouped_experts(x, w_gate_up, b_gate_up, w_down, b_down, chosen, weights, glu): every
    routed expert of a step as two grouped matmuls over stacked weights (Triton: no host
    sync, so a CUDA graph holds them); None: each expert as its own module call."""

    store_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable
    row_attention: Callable | None = None
    rms_norm: Callable | None = None
    grouped_experts: Callable | None = None
