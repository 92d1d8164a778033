"""The quantized matmuls behind decode rows (decode_quant.py applies them to a model): torch's
int4/int8 weight-only ops, and the C kernels' 4-bit and q8-family forms (kernels/csrc/), with
the requantizations that give a float weight one of those forms."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from engine_core.weights.gguf_q4 import GROUP_SIZE, Q4Weight
from engine_core.weights.gguf_q8 import NLWeight, Q8Weight
from kernels import native

ACT_DTYPE = torch.bfloat16
# config.ACTIVATIONS as the C kernels number them (cpu_kernels.h's ACT_*)
ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1, "swiglu_oai": 2}


class Int4Matmul(nn.Module):
    """x @ W.T with W as packed 4-bit integers, per-group scale and zero."""

    def __init__(self, w: Q4Weight) -> None:
        super().__init__()
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
        )
        scales_zeros = torch.stack([w.scale.t(), w.zero.t()], dim=-1)  # [K / 32, N, 2]
        self.register_buffer("scales_zeros", scales_zeros.to(ACT_DTYPE).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, K] -> [m, N] bf16
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(ACT_DTYPE), self.packed, GROUP_SIZE, self.scales_zeros
        )


class Int8Matmul(nn.Module):
    """x @ W.T with W as int8 and one scale per output row."""

    def __init__(self, weight: torch.Tensor) -> None:  # [N, K] float
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [N]
        self.register_buffer("w", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(ACT_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, K] -> [m, N] bf16
        return torch.ops.aten._weight_int8pack_mm(x.to(ACT_DTYPE), self.w, self.scale)


class _NativeMatmul(nn.Module):
    """What the C kernels' matmuls share: the call, and the Matrix that pd_decode_layers
    takes. A subclass sets n, k, int8, kind, _fn and _weights (qs, d, c pointers)."""

    def matrix(self, bias: torch.Tensor | None) -> native.Matrix:
        return native.Matrix(self.kind, self.int8, self.n, self.k, *self._weights,
                             None if bias is None else bias.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, K] -> [m, N] float32
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        out = torch.empty((x.shape[0], self.n), dtype=torch.float32)
        native.check(self._fn(x.data_ptr(), x.shape[0], self.k, *self._weights, self.n,
                              out.data_ptr(), torch.get_num_threads()))
        return out


class NativeQ4Matmul(_NativeMatmul):
    """x @ W.T with the GGUF's 4-bit blocks (kernels/csrc/matmul*.c): float32 activations,
    or with int8 ones quantized per group of 32 (pd_i8_matmul, the VNNI build's tiles).

    The packed weights are plain attributes, not buffers: `.to()` leaves them where the kernel
    reads them (its pointers are taken once, here), and the dense twin keeps the state dict.
    """

    def __init__(self, w: Q4Weight, lib, int8: bool = False) -> None:
        super().__init__()
        self.n, self.k = w.q.shape
        self.int8, self.kind = int8, 4
        # w = q * d + c: c the constant part of each group, multiplied into the group sums of x
        c = w.m - w.offset[:, None] * w.d
        if int8:
            self.qs, self.d, self.c = native.pack_q4_int8(w.q, w.d, c)
            self._fn = lambda x, m, k, *rest: lib.pd_i8_matmul(x, m, k, 4, *rest)
        else:
            self.qs = w.packed_nibbles()  # [N, K / 32, 16]
            self.d, self.c = w.d.float().contiguous(), c.float().contiguous()  # [N, K / 32]
            self._fn = lib.pd_q4_matmul
        self._weights = (self.qs.data_ptr(), self.d.data_ptr(), self.c.data_ptr())


class NativeQ8Matmul(_NativeMatmul):
    """x @ W.T with W in the C kernels' q8 family (kernels/csrc/cpu_kernels.h): int8 q and a
    scale (and a constant) per group of 32 or 16 along K; float32 activations, or int8 ones as
    in NativeQ4Matmul.

    `weight` is either a GGUF tensor's own integers and scales (a Q8Weight: any type of
    gguf_q8.Q8_TYPES, or a fused projection of those and 4-bit parts; an NLWeight: IQ4_NL,
    IQ4_XS and MXFP4's 4-bit indices and table, kind 9), exactly the file's values, or a
    float tensor, requantized to int8 with one scale per 32. A Q8_0 tensor (as
    the default model's embedding) is requantized exactly: its dense weight is d * q with |q|
    reaching 127 in every block, so amax / 127 gives d back and q follows; `d`, given, makes
    that exact for any tensor whose dense weight is d times an integer in -127..127 per group
    of 32.
    Plain attributes, as in NativeQ4Matmul.
    """

    def __init__(self, weight: torch.Tensor | Q8Weight | NLWeight, lib, int8: bool = False,
                 d: torch.Tensor | None = None) -> None:  # d: [N, K / 32] float32
        super().__init__()
        if not isinstance(weight, Q8Weight | NLWeight):
            weight = requantize_int8(weight, d)
        self.n, self.k = weight.q.shape
        self.int8, self.kind = int8, weight.kind
        if isinstance(weight, NLWeight):  # q4's nibbles, `c` the table (kind 9)
            self.c = weight.table.contiguous()
            if int8:
                self.qs, self.d, _ = native.pack_q4_int8(weight.q, weight.d,
                                                        torch.zeros_like(weight.d))
                self._fn = lambda x, m, k, *rest: lib.pd_i8_matmul(x, m, k, self.kind, *rest)
            else:
                self.qs, self.d = weight.packed_nibbles(), weight.d.float().contiguous()
                self._fn = lambda x, m, k, *rest: lib.pd_q8_matmul(x, m, k, self.kind, *rest)
        elif int8:
            self.qs, self.d, self.c = native.pack_q8_int8(weight.q, weight.d, weight.c)
            self._fn = lambda x, m, k, *rest: lib.pd_i8_matmul(x, m, k, self.kind, *rest)
        else:
            self.qs, self.d = weight.q.contiguous(), weight.d.float().contiguous()
            self.c = None if weight.c is None else weight.c.float().contiguous()
            self._fn = lambda x, m, k, *rest: lib.pd_q8_matmul(x, m, k, self.kind, *rest)
        self._weights = (self.qs.data_ptr(), self.d.data_ptr(),
                         None if self.c is None else self.c.data_ptr())

    def expanded(self) -> torch.Tensor:  # [N, K] float32
        """The weight the float32-activation kernel multiplies, as it expands it."""
        if self.int8:
            raise ValueError("expanded: the int8 packing is tiled; build with int8=False")
        if self.kind == 9:  # a group's byte j holds index j (low nibble) and j + 16 (high)
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).view(self.n, self.k)
            return self.c[q.long()].float() * self.d.repeat_interleave(GROUP_SIZE, dim=1)
        group = 16 if self.kind in (6, 7) else GROUP_SIZE
        w = self.qs.float() * self.d.repeat_interleave(group, dim=1)
        return w if self.c is None else w + self.c.repeat_interleave(group, dim=1)


class NativeFloatMatmul(_NativeMatmul):
    """x @ W.T with W the model's own float32 or bfloat16 weight, as loaded (kind 32 or 16 of
    pd_q8_matmul), float32 activations: nothing is quantized. It reads the dense weight in
    place (no copy), so a float model's decode rows can take the one-call C layers too
    (NativeDecodeLayers) rather than a torch matmul per projection and layer. Batch and thread
    invariant as the other kinds; its sums differ from torch's by float32 rounding."""

    KINDS = {torch.float32: 32, torch.bfloat16: 16}

    def __init__(self, weight: torch.Tensor, lib) -> None:  # [N, K], float32 or bfloat16
        super().__init__()
        if weight.dtype not in self.KINDS or not weight.is_contiguous():
            raise ValueError(f"NativeFloatMatmul takes a contiguous float32 or bfloat16 weight, "
                             f"got {weight.dtype}")
        self.n, self.k = weight.shape
        self.int8, self.kind = False, self.KINDS[weight.dtype]
        self.qs = weight.detach()  # the dense weight's own storage
        self._fn = lambda x, m, k, *rest: lib.pd_q8_matmul(x, m, k, self.kind, *rest)
        self._weights = (self.qs.data_ptr(), None, None)


@dataclass(frozen=True)
class NativeExperts:
    """A mixture's routed experts for its decode rows in one C call per layer
    (pd_moe_experts): SparseMoE.decode_experts, set by quantize_for_decode where every
    expert's matrices are the C kernels'."""

    lib: ctypes.CDLL
    gate_up: ctypes.Array  # each expert's gate_up Matrix
    down: ctypes.Array  # each expert's down Matrix
    width: int  # an expert's intermediate size
    act: tuple  # (ACT_CODES[hidden_act], swiglu_alpha, swiglu_limit)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor,
                 pair_weights: torch.Tensor) -> torch.Tensor:  # [nq, hidden] float32
        """x: [nq, hidden] float32; the (row, expert) pairs grouped by expert (counts per
        expert, each pair's row and weight, rows ascending within a group)."""
        return native.moe_experts(self.lib, x, self.gate_up, self.down, self.width, self.act,
                                  counts, rows, pair_weights, torch.zeros_like(x))


def c_matrix(linear: nn.Module) -> native.Matrix:
    """The C kernels' Matrix of a projection whose decode rows multiply in them (a
    DecodeQuantLinear of a _NativeMatmul): its bias as a float32 copy the matmul keeps
    alive, or NULL."""
    bias = linear.dense.bias
    if bias is not None:
        linear.quant.bias32 = bias = bias.detach().float().contiguous()
    return linear.quant.matrix(bias)


def c_matrices(linears: list[nn.Module]) -> ctypes.Array:
    """c_matrix of each, as a ctypes array (a mixture of experts' gate_up or down)."""
    return (native.Matrix * len(linears))(*map(c_matrix, linears))


def requantize_int8(weight: torch.Tensor, d: torch.Tensor | None = None) -> Q8Weight:
    """A float [N, K] weight as int8 with one scale per 32 along K: d [N, K / 32] if given (a
    file's own), else amax / 127 of each group."""
    n, k = weight.shape
    w = weight.float().view(n, -1, GROUP_SIZE)  # [N, K / 32, 32]
    if d is None:
        d = w.abs().amax(dim=2) / 127  # [N, K / 32]
    d = d.float()
    # a file's d may be negative; a zero d has zero weights
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(w / safe_d[..., None]).to(torch.int8).view(n, k)
    return Q8Weight(q, d, None)


def requantize_int4(weight: torch.Tensor, chunk_rows: int = 16384) -> Q4Weight:
    """A float [N, K] weight as 4-bit integers with a scale and a minimum per 32 along K (min-max,
    as Q4_1): w ~ q * d + m, q = round((w - m) / d) in 0..15, d = (max - min) / 15 and m = min
    of each group, so each weight is within d / 2 of its value. Lossy: decode_quant.py uses it
    only to screen the lm_head's candidates. Converted chunk_rows rows at a time (a 262k
    vocabulary's float32 copy would be 670 MB)."""
    n, k = weight.shape
    qs, ds, ms = [], [], []
    for start in range(0, n, chunk_rows):
        w = weight[start:start + chunk_rows].float().view(-1, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [rows, K / 32]
        d = (hi - lo) / 15
        safe_d = torch.where(d == 0, torch.ones_like(d), d)  # a constant group: q = 0, w = m
        q = torch.round((w - lo[..., None]) / safe_d[..., None]).clamp_(0, 15)
        qs.append(q.to(torch.uint8).view(-1, k))
        ds.append(d)
        ms.append(lo)
    return Q4Weight(torch.cat(qs), torch.cat(ds), torch.cat(ms), torch.zeros(n))
