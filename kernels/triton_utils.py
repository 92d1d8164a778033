"""Helpers shared by the Triton wrappers: launching on CPU tensors and dtype mapping.

Triton reads TRITON_INTERPRET when a function is *decorated*: at `import triton` for its own
`@jit` helpers (`tl.zeros`, `tl.max`, `tl.sum`, ...) and at our module import for our kernels.
So the interpreter (the only way to run these kernels on CPU tensors) needs TRITON_INTERPRET=1
before triton is first imported in the process; tests/kernels/conftest.py arranges that.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# the window the attention kernels get for "no sliding window": reaches back past position 0
# for any context a block table can hold, and stays far from int32 overflow
NO_WINDOW = 1 << 30


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (runs in numpy, any device)."""
    return isinstance(kernel, InterpretedFunction)


def launchable(kernel: Any, device: torch.device) -> Any:
    """`kernel`, after checking it can run on tensors on `device`; on a CUDA device, launched
    with that device current (_OnDevice).

    CPU tensors need the interpreter, i.e. TRITON_INTERPRET=1 before triton's first import.
    """
    if device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "Triton kernels run on CPU tensors only in the interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (or use PDSERVE_ATTN_BACKEND=torch)"
        )
    if device.type == "cuda" and not is_interpreted(kernel):
        return _OnDevice(kernel, device)
    return kernel


class _OnDevice:
    """A kernel whose launches make `device` current first. Triton launches on the current
    device's current stream, not on its tensors' device: from a thread whose current device
    is 0, a kernel over cuda:1 tensors would run on device 0's stream (a fault, or without
    order against device 1's work)."""

    def __init__(self, kernel: Any, device: torch.device) -> None:
        self.kernel, self.device = kernel, device

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.cuda.device(self.device):
                return launch(*args, **kwargs)

        return run


def compute_dtype(dtype: torch.dtype, interpreted: bool) -> tuple[Any, str]:
    """(tile dtype for `tl.dot`, dot input precision) for KV/query of `dtype`.

    fp32 tiles use exact "ieee" dots (no TF32). bf16/fp16 tiles feed tensor cores natively with
    fp32 accumulation on GPU; the interpreter cannot do bf16 arithmetic (it multiplies the
    uint16 bit patterns, triton#11584), so there tiles are upcast to fp32 first.
    """
    if dtype == torch.float32 or interpreted:
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "tf32"  # precision only applies to fp32 operands


def block_dim(n: int) -> int:
    """A power-of-two tile extent ≥ n and ≥ 16 (the minimum `tl.dot` operand size)."""
    return max(16, triton.next_power_of_2(n))
