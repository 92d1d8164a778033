"""The decoder's feed-forward blocks: the gated MLP, and routed experts in its place for the
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE), with the checkpoint names of Mixtral's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import ModelConfig
from engine_core.model.forward_context import current, use
from kernels import native

ACTIVATIONS = {  # config.ACTIVATIONS names the same set
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """The gated MLP, `width` wide (default: the config's intermediate_size)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        self.intermediate = width or cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SparseMoE(nn.Module):
    """Routed experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the router (`gate`,
    kept dense for every row, so that a token picks the same experts whatever its path) ranks
    the experts per token; the top num_experts_per_tok run on it, their outputs weighted by
    the softmax probabilities (renormalized over the chosen where norm_topk_prob). Qwen2-MoE
    adds a shared expert on every token, scaled by sigmoid(shared_expert_gate(x)).

    Each expert runs once per step on its tokens, gathered in row order, so a step's decode
    rows (the first rows) stay first: the expert's quantized matmuls take exactly those
    (the forward context's num_quant_rows, recounted per expert). Where every expert's
    matrices are the C kernels' (`native`, set by decode_quant.quantize_for_decode), the
    decode rows' experts run in one C call per layer instead (pd_moe_experts), float32; and
    where every layer is in C, pd_decode_layers computes the whole MLP of the decode rows
    (router included) and this forward sees prefill rows only."""

    native = None  # (lib, gate_up Matrix array, down Matrix array, gelu): see decode_quant

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        probs = self.gate(x.to(self.gate.weight.dtype)).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [n, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        ctx = current()
        nq = min(ctx.num_quant_rows, x.shape[0])
        if self.native is not None and nq:  # decode rows in C, the rest below
            out = self._native_rows(x[:nq], chosen[:nq], weights[:nq]).to(x.dtype)
            if nq < x.shape[0]:
                with use(dataclasses.replace(ctx, num_quant_rows=0)):
                    rest = self._routed(x[nq:], chosen[nq:], weights[nq:].to(x.dtype), 0)
                out = torch.cat([out, rest])
        else:
            out = self._routed(x, chosen, weights.to(x.dtype), nq)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x.to(self.gate.weight.dtype)))
            out = out + gate.to(x.dtype) * self.shared_expert(x)
        return out

    def _grouped(self, chosen: torch.Tensor, weights: torch.Tensor):
        """The (row, expert) pairs grouped by expert, rows ascending within each group: pairs
        per expert, each pair's row and weight."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts))
        return counts, order // self.top_k, weights.reshape(-1)[order]

    def _routed(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                nq: int) -> torch.Tensor:
        """Each expert on its rows, in module calls; the first nq rows are decode rows."""
        counts, rows, pair_weights = self._grouped(chosen, weights)
        num_experts = len(self.experts)
        quant_counts = (torch.bincount(chosen[:nq].reshape(-1), minlength=num_experts).tolist()
                        if nq else [0] * num_experts)
        ctx = current()
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts.tolist()):
            if not count:
                continue
            idx = rows[start : start + count]
            with use(dataclasses.replace(ctx, num_quant_rows=quant_counts[e])):
                y = self.experts[e](x[idx])
            out.index_add_(0, idx, y * pair_weights[start : start + count, None])
            start += count
        return out

    def _native_rows(self, x: torch.Tensor, chosen: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:  # [nq, hidden] float32
        lib, gate_up, down, gelu = self.native
        counts, rows, pair_weights = self._grouped(chosen, weights)
        xf = x.float().contiguous()
        return native.moe_experts(lib, xf, gate_up, down, self.experts[0].intermediate, gelu,
                                  counts, rows.contiguous(), pair_weights.float().contiguous(),
                                  torch.zeros_like(xf))


# Mixtral's checkpoint names for its experts, as the rest of the decoder names them (Qwen's)
_MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_name(name: str) -> str:
    """A checkpoint's weight name with Mixtral's `block_sparse_moe.experts.E.w1` written as
    `mlp.experts.E.gate_proj` (w3: up_proj, w2: down_proj) and its router as `mlp.gate`."""
    if ".block_sparse_moe." not in name:
        return name
    parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
    if len(parts) >= 2 and parts[-2] in _MIXTRAL_EXPERT_NAMES and "experts" in parts:
        parts[-2] = _MIXTRAL_EXPERT_NAMES[parts[-2]]
    return ".".join(parts)
