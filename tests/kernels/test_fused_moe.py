"""The routed experts' grouped matmuls (kernels/fused_moe.py) against the experts one pair at
a time, and its routing's alignment: on CUDA when present, else in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from engine_core.model.feed_forward import swiglu_oai
from kernels.fused_moe import align, block_m, capacity, fused_experts

ACTS = {"silu": lambda gate, up: F.silu(gate) * up,
        "swiglu_oai": lambda gate, up: swiglu_oai(gate, up, 1.702, 7.0)}


def experts(num_experts: int, hidden: int, width: int, bias: bool, device, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    return (rand(num_experts, 2 * width, hidden, scale=hidden ** -0.5),
            rand(num_experts, 2 * width) if bias else None,
            rand(num_experts, hidden, width, scale=width ** -0.5),
            rand(num_experts, hidden) if bias else None)


def routing(n: int, num_experts: int, top_k: int, seed: int, skew: bool = False):
    """chosen [n, k] (distinct experts per token) and their weights; `skew`: most tokens on
    expert 0, so that one expert's run spans several programs and others are empty."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, num_experts, generator=g)
    if skew:
        scores[:, 0] += 1.0
    chosen = scores.topk(top_k, dim=-1).indices
    return chosen, torch.rand(n, top_k, generator=g)


def reference(x, w_gate_up, b_gate_up, w_down, b_down, chosen, weights, act) -> torch.Tensor:
    """Each (token, expert) pair on its own, in float64."""
    width = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, w_gate_up, w_down = x.double().cpu(), w_gate_up.double().cpu(), w_down.double().cpu()
    for t in range(x.shape[0]):
        for j, e in enumerate(chosen[t].tolist()):
            h = w_gate_up[e] @ x[t] + (0 if b_gate_up is None else b_gate_up[e].double().cpu())
            y = w_down[e] @ act(h[:width], h[width:])
            out[t] += float(weights[t, j]) * (y + (0 if b_down is None else
                                                   b_down[e].double().cpu()))
    return out


@pytest.mark.parametrize(("n", "num_experts", "top_k", "bias", "act", "skew"), [
    (1, 8, 2, False, "silu", False),
    (7, 8, 2, True, "swiglu_oai", False),
    (40, 6, 3, False, "silu", True),
    (600, 4, 2, True, "silu", False),  # 1,200 pairs: programs of 64
])
def test_triton_fused_experts_equal_each_pair_alone(triton_device, n, num_experts, top_k,
                                                    bias, act, skew):
    hidden, width = 40, 24  # neither a multiple of the tiles: every mask is in play
    weights_ = experts(num_experts, hidden, width, bias, triton_device, torch.float32, n)
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(1)).to(triton_device)
    chosen, weights = routing(n, num_experts, top_k, n, skew)
    out = fused_experts(x, *weights_, chosen.to(triton_device), weights.to(triton_device),
                        ACTS[act])
    assert out.shape == x.shape and out.dtype == x.dtype
    want = reference(x, *weights_, chosen, weights, ACTS[act])
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fused_experts_in_half_precision(triton_device, dtype):
    """The GPU's defaults: tiles in the weights' dtype, float32 accumulation, the
    intermediate in x's dtype (as the per-expert modules round it)."""
    n, num_experts, hidden, width = 33, 8, 64, 32
    weights_ = experts(num_experts, hidden, width, True, triton_device, dtype, 3)
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(4)).to(triton_device, dtype)
    chosen, weights = routing(n, num_experts, 2, 5)
    out = fused_experts(x, *weights_, chosen.to(triton_device), weights.to(triton_device),
                        ACTS["silu"])
    want = reference(x, *weights_, chosen, weights, ACTS["silu"])
    assert out.dtype == dtype
    err = (out.double().cpu() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


def test_triton_fused_experts_of_no_rows_give_no_output(triton_device):
    weights_ = experts(4, 16, 16, False, triton_device, torch.float32, 0)
    x = torch.zeros(0, 16, device=triton_device)
    chosen = torch.zeros(0, 2, dtype=torch.long, device=triton_device)
    out = fused_experts(x, *weights_, chosen, torch.zeros(0, 2, device=triton_device),
                        ACTS["silu"])
    assert out.shape == (0, 16)


@pytest.mark.parametrize(("n", "num_experts", "top_k", "skew"), [
    (1, 128, 8, False), (5, 4, 2, False), (300, 16, 4, True), (700, 64, 2, False)])
def test_align_groups_every_pair_once_by_expert(n, num_experts, top_k, skew):
    chosen, _ = routing(n, num_experts, top_k, n, skew)
    block = block_m(n * top_k)
    pairs, block_expert, used = align(chosen, num_experts, block)
    flat = chosen.reshape(-1)
    assert pairs.numel() == capacity(n * top_k, num_experts, block)
    assert pairs.numel() % block == 0 and block_expert.numel() == pairs.numel() // block
    used = int(used)
    real = pairs[pairs < n * top_k]
    assert sorted(real.tolist()) == list(range(n * top_k))  # every pair once
    assert (pairs[used:] == n * top_k).all()  # nothing past the used slots
    for b in range(used // block):
        run = pairs[b * block:(b + 1) * block]
        run = run[run < n * top_k].long()
        assert (flat[run] == block_expert[b]).all()  # one expert per program
        assert run.tolist() == sorted(run.tolist())  # rows ascending within it
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block - 1) // block * block).sum())


class NoHostSync(TorchFunctionMode):
    """Fails on the ops that read a tensor back to the host (what a CUDA graph cannot hold)."""

    SYNCS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__",
                       "__float__", "nonzero", "unique", "masked_select", "bincount"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCS:
            raise AssertionError(f"{name} reads a tensor back to the host")
        return func(*args, **(kwargs or {}))


def test_align_reads_nothing_back_to_the_host():
    chosen, _ = routing(9, 16, 4, 0)
    with NoHostSync():
        pairs, block_expert, used = align(chosen, 16, 16)
    assert int(used) == 9 * 4 + sum(15 - (c - 1) % 16 for c in
                                    torch.bincount(chosen.reshape(-1)).tolist() if c)
    with pytest.raises(AssertionError, match="item"), NoHostSync():
        used.item()
