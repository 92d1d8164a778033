"""Attention and KV-cache kernels over the paged KV layout (engine_core/kv_cache/layout.py).

Each kernel has five parts: a Triton kernel with its checking wrapper (`store_kv_triton.py`,
`decode_attention.py`, `prefill_attention.py`), a torch reference (`reference.py`), a fast torch
path for CPU (`cpu_attention.py`), tests (tests/kernels/) and a benchmark
(benchmarks/bench_kernels.py); the CPU's C kernels are `native.py` over `csrc/`.
`backends.py` is the one selection among them, made once per engine by its platform
(engine_core/platforms/).
"""
