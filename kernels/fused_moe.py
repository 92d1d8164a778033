"""A mixture of experts' routed experts in two grouped matmuls (Triton), for the GPU path: no
host sync and shapes fixed by the token count, so a decode step's CUDA graph captures it.

    chosen [n, k]: the router's experts per token; pair p = token * k + slot
    align     the pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
              with the sentinel n * k; each BLOCK_M pairs' expert; how many are used
    matmul 1  h[p] = x[p // k] @ w_gate_up[e(p)]^T (+ b_gate_up[e(p)])     [n * k, 2 * width]
    act       a[p] = act(h[p, :width], h[p, width:])                       [n * k, width]
    matmul 2  y[p] = weight[p] * (a[p] @ w_down[e(p)]^T (+ b_down[e(p)]))  [n * k, hidden] fp32
    out[t] = sum of y[t * k + slot] over the k slots

A program of the matmul kernel takes BLOCK_M pairs of one expert and BLOCK_N output columns,
reading the expert's weight tile once for all of them. Each expert's weights are read once
per step whatever its token count, as the per-expert loop did, in two launches instead of
several per expert. Programs past the used pairs (the capacity is for the worst spread of
pairs over experts) return at once.

The torch loop over experts (feed_forward.SparseMoE._routed) is the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.triton_utils import compute_dtype, is_interpreted, launchable

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _expert_matmul_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, pairs_ptr, block_expert_ptr,
                          used_ptr, pair_weight_ptr, num_pairs, N, K, a_row_div,
                          stride_a, stride_we, stride_out,
                          HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
                          TILE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # the padding's sentinel is num_pairs
    rows = (pairs // a_row_div).to(tl.int64)  # the input row each pair reads
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_cols = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * K  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a.to(TILE_DTYPE), w.to(TILE_DTYPE), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc *= tl.load(pair_weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def block_m(num_pairs: int) -> int:
    """Pairs per program: 16 (tl.dot's least) for decode-sized steps, 64 for prefill."""
    return 16 if num_pairs <= 1024 else 64


def capacity(num_pairs: int, num_experts: int, block: int) -> int:
    """Slots for the sorted, padded pairs, whatever their spread: each expert that has pairs
    (at most min(experts, pairs) do) pads its run by under `block`."""
    slots = num_pairs + min(num_experts, num_pairs) * (block - 1)
    return -(-slots // block) * block


def align(chosen: torch.Tensor, num_experts: int, block: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, block_expert, used) for chosen [n, k] (expert ids, int64), all on its device
    and computed there without a host sync:

        pairs        [capacity] int32: pair ids grouped by expert, ascending within an
                     expert, each expert's run padded to a multiple of `block` with n * k
        block_expert [capacity / block] int32: the expert of each `block` slots
        used         [1] int32: the slots in use (programs past them return)
    """
    flat = chosen.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)  # where each expert's padded run ends
    order = torch.argsort(flat, stable=True)  # pair ids by expert, ascending within one
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[by_expert]
    slots = (ends - padded)[by_expert] + rank
    size = capacity(num_pairs, num_experts, block)
    pairs = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, slots, order.to(torch.int32))
    starts = torch.arange(0, size, block, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


def _expert_matmul(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   block: int, a_row_div: int, pair_weights: torch.Tensor | None) -> None:
    """out[p] = (pair_weights[p] *) (a[p // a_row_div] @ w[e(p)]^T (+ bias[e(p)])) for every
    pair p of `routing` (align's output)."""
    pairs, block_expert, used = routing
    num_pairs, (_, n, k) = out.shape[0], w.shape
    kernel = launchable(_expert_matmul_kernel, a.device)
    tile_dtype, precision = compute_dtype(w.dtype, is_interpreted(kernel))
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    kernel[grid](a, w, w if bias is None else bias, out, pairs, block_expert, used,
                 out if pair_weights is None else pair_weights, num_pairs, n, k, a_row_div,
                 a.stride(0), w.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                 WEIGHTED=pair_weights is not None, TILE_DTYPE=tile_dtype,
                 DOT_PRECISION=precision, BLOCK_M=block, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, b_gate_up: torch.Tensor | None,
                  w_down: torch.Tensor, b_down: torch.Tensor | None, chosen: torch.Tensor,
                  weights: torch.Tensor,
                  act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over j of weights[t, j] * expert_{chosen[t, j]}(x[t]) for each row t, where
    expert_e(v) = down_e(act(gate_e(v), up_e(v))) (with biases where given).

    x [n, hidden]; w_gate_up [E, 2 * width, hidden] (gate rows, then up rows), b_gate_up
    [E, 2 * width]; w_down [E, hidden, width], b_down [E, hidden]; chosen [n, k] int64;
    weights [n, k] float32. Returns [n, hidden] in x's dtype."""
    n, top_k = chosen.shape
    num_pairs = n * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    width = w_down.shape[2]
    x = x.contiguous()
    block = block_m(num_pairs)
    routing = align(chosen, w_gate_up.shape[0], block)
    h = torch.empty((num_pairs, 2 * width), dtype=x.dtype, device=x.device)
    _expert_matmul(x, w_gate_up, b_gate_up, h, routing, block, top_k, None)
    a = act(h[:, :width], h[:, width:]).contiguous()
    y = torch.empty((num_pairs, x.shape[1]), dtype=torch.float32, device=x.device)
    _expert_matmul(a, w_down, b_down, y, routing, block, 1,
                   weights.reshape(-1).float().contiguous())
    return y.view(n, top_k, -1).sum(dim=1).to(x.dtype)
