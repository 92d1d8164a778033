"""Which kernels compute attention: the whole matrix, in one place.

| device | default | `PDSERVE_ATTN_BACKEND=` |
| --- | --- | --- |
| CUDA | `triton`: kernels/decode_attention.py, prefill_attention.py, store_kv_triton.py | `torch` |
| CPU | `native`: the C kernels (kernels/csrc, loaded by kernels/native.py) attend row by row, rope and K/V store included; `torch` where they do not load | `torch`; `triton` (only with `TRITON_INTERPRET=1`, the tests' way to run the Triton kernels on CPU) |

The C library loads unless `PDSERVE_NATIVE=0`, there is no C compiler and no prebuilt
library (`PDSERVE_NATIVE_DIR`), or the CPU lacks AVX2/FMA; `PDSERVE_NATIVE=avx2|avx512`
picks a narrower build. `native` is chosen once per model (its attention modules hold the
library: engine_core/model_loader.py); `triton` and `torch` per call (kernels/dispatch.py).
The decode rows' 4/8-bit matmuls are another matter: engine_core/model/decode_quant.py.
"""

from __future__ import annotations

import os

import torch

from kernels import native

BACKEND_ENV = "PDSERVE_ATTN_BACKEND"
ATTENTION_BACKENDS = ("native", "triton", "torch")


def forced_backend() -> str | None:
    """PDSERVE_ATTN_BACKEND, checked (read on every call), or None when unset."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not forced:
        return None
    if forced not in ATTENTION_BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {ATTENTION_BACKENDS}, got {forced!r}")
    return forced


def attention_backend(device: torch.device) -> str:
    """The backend a model on `device` attends with: "native", "triton" or "torch"."""
    forced = forced_backend()
    if forced == "native" and device.type != "cpu":
        raise ValueError(f"{BACKEND_ENV}=native is the CPU's C kernels; the device is {device}")
    if forced is not None:
        return forced
    if device.type == "cuda":
        return "triton"
    return "native" if native.load() is not None else "torch"


def per_call_backend(device: torch.device) -> str:
    """What kernels.dispatch runs for tensors on `device`: "triton" or "torch" (the native
    backend is not called through it: where a model uses it, its modules call the C kernels)."""
    forced = forced_backend()
    if forced in ("triton", "torch"):
        return forced
    return "triton" if device.type == "cuda" else "torch"
