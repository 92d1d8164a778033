"""Attention and KV-cache kernels over the paged KV layout (engine_core/kv_cache/layout.py).

Each kernel has five parts: a Triton kernel with its checking wrapper (`store_kv_triton.py`,
`decode_attention.py`, `prefill_attention.py`), a torch reference (`reference.py`), a fast torch
path for CPU (`cpu_attention.py`), tests (tests/kernels/) and a benchmark
(benchmarks/bench_kernels.py). `dispatch.py` picks the backend per call.
"""

from __future__ import annotations

from kernels.dispatch import paged_decode_attention, paged_prefill_attention, store_kv

# the Triton module is store_kv_triton.py: a submodule named store_kv would shadow this function

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
