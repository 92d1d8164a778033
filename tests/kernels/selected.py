"""The attention kernels as an engine's model calls them, for the kernel tests: those of the
backend PDSERVE_ATTN_BACKEND selects (the `torch_backend` and `triton_backend` fixtures set
it; unset: the torch path), through kernels/backends.py's one selection."""

from __future__ import annotations

from kernels.backends import AttentionKernels, attention_kernels, forced_backend


def selected() -> AttentionKernels:
    return attention_kernels(forced_backend() or "torch")


def store_kv(key, value, kv_layer, slot_mapping, step_cache=None) -> None:
    selected().store_kv(key, value, kv_layer, slot_mapping, step_cache)


def paged_decode_attention(*args, **kwargs):
    return selected().decode(*args, **kwargs)


def paged_prefill_attention(*args, **kwargs):
    return selected().prefill(*args, **kwargs)
