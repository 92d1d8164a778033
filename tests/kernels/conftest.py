"""Kernel tests also run the Triton kernels: on CUDA when present, else in the Triton
interpreter on CPU tensors.

The interpreter must be on before triton is *first imported* in the process: `import triton`
decorates triton's own `@jit` helpers (`tl.zeros`, `tl.max`, ...) and our kernel modules
decorate theirs at import, each reading TRITON_INTERPRET at that moment. Importing torch does
not import triton (importing torch._dynamo does), so setting it here, when pytest loads this
conftest, works unless an earlier test folder imported triton at collection. In that case the
in-process Triton tests skip and test_triton_fresh_process.py reruns them in a new process.

Side effect, CPU-only machines only: TRITON_INTERPRET=1 stays set for the rest of the test
process, which is the only way any Triton kernel can run there anyway.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_skip_reason() -> str | None:
    """Why the Triton kernels cannot run in this process, or None if they can."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return "triton is not installed"
    if HAS_CUDA:
        return None
    from kernels.decode_attention import _paged_decode_kernel

    if not isinstance(_paged_decode_kernel, InterpretedFunction):
        return (
            "triton was imported before TRITON_INTERPRET=1 was set; "
            "test_triton_fresh_process.py reruns the Triton tests in a new process"
        )
    return None


@pytest.fixture
def triton_unavailable() -> str | None:
    """Why the Triton tests skip in this process, or None if they run here."""
    return triton_skip_reason()


@pytest.fixture
def triton_device() -> torch.device:
    """The device the Triton kernels run on here: cuda, or cpu through the interpreter."""
    reason = triton_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the public API to the fast torch path."""
    monkeypatch.setenv("PDSERVE_ATTN_BACKEND", "torch")


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch, triton_device: torch.device) -> torch.device:
    """Route the public API to the Triton kernels; returns their device."""
    monkeypatch.setenv("PDSERVE_ATTN_BACKEND", "triton")
    return triton_device
