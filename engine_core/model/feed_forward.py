"""The decoder's feed-forward blocks: the gated MLP, and routed experts in its place for the
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS), with the checkpoint names of
Mixtral's and GPT-OSS's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Set

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import ModelConfig
from engine_core.model.forward_context import current, use


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float,
               limit: float) -> torch.Tensor:
    """GPT-OSS's gated unit: gate * sigmoid(alpha * gate) * (up + 1), gate clamped to at most
    `limit` and up to [-limit, limit]."""
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + 1)


def glu(cfg: ModelConfig):
    """The config's act(gate, up) (config.ACTIVATIONS)."""
    if cfg.hidden_act == "swiglu_oai":
        alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit
        return lambda gate, up: swiglu_oai(gate, up, alpha, limit)
    if cfg.hidden_act == "gelu_pytorch_tanh":
        return lambda gate, up: F.gelu(gate, approximate="tanh") * up
    return lambda gate, up: F.silu(gate) * up


class MLP(nn.Module):
    """The gated MLP, `width` wide (default: the config's intermediate_size), with biases on
    its projections where `bias` (GPT-OSS's experts)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = width or cfg.intermediate_size
        self.glu = glu(cfg)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.glu(gate, up))


class SparseMoE(nn.Module):
    """Routed experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the router (`gate`,
    kept dense for every row, so that a token picks the same experts whatever its path) ranks
    the experts per token; the top num_experts_per_tok run on it, their outputs weighted by
    the softmax probabilities (renormalized over the chosen where norm_topk_prob). Qwen2-MoE
    adds a shared expert on every token, scaled by sigmoid(shared_expert_gate(x)).

    Each expert runs once per step on its tokens, gathered in row order, so a step's decode
    rows (the first rows) stay first: the expert's quantized matmuls take exactly those
    (the forward context's num_quant_rows, recounted per expert). Where every expert's
    matrices are the C kernels' (`decode_experts`, set by the CPU platform's decode
    quantization: platforms/cpu/decode_quant.py), the decode rows' experts run in one call
    per layer instead (pd_moe_experts), float32; and where every layer is in C,
    pd_decode_layers computes the whole MLP of the decode rows (router included) and this
    forward sees prefill rows only.

    With the platform's `grouped` experts (Triton, a GPU: ModelOps.grouped_experts) every
    row's experts run as two grouped matmuls over the experts' stacked weights instead
    (`stack_experts`): no host sync, so a decode step's CUDA graph holds the experts too."""

    # decode_experts(x [nq, hidden], counts, rows, pair_weights) -> [nq, hidden] float32
    decode_experts = None
    # (w_gate_up [E, 2 * width, hidden], its bias or None, w_down [E, hidden, width], its
    # bias or None): set by stack_experts, for `grouped`
    stacked = None

    def __init__(self, cfg: ModelConfig, grouped=None) -> None:
        super().__init__()
        self.grouped = grouped
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size, cfg.expert_bias)
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
        if self.stacked is not None:
            out = self.grouped(x, *self.stacked, chosen, weights, self.experts[0].glu)
        elif self.decode_experts is not None and nq:  # decode rows in C, the rest below
            out = self._decode_rows(x[:nq], chosen[:nq], weights[:nq]).to(x.dtype)
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

    def stack_experts(self) -> None:
        """Each of the experts' weights and biases as one stacked tensor (`stacked`); the
        experts' own parameters become views of it, so nothing is held twice."""
        stacked = []
        for proj, attr in (("gate_up_proj", "weight"), ("gate_up_proj", "bias"),
                           ("down_proj", "weight"), ("down_proj", "bias")):
            parts = [getattr(getattr(e, proj), attr) for e in self.experts]
            if parts[0] is None:
                stacked.append(None)
                continue
            whole = torch.stack([p.detach() for p in parts])
            for e, view in zip(self.experts, whole, strict=True):
                setattr(getattr(e, proj), attr, nn.Parameter(view, requires_grad=False))
            stacked.append(whole)
        self.stacked = tuple(stacked)

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

    def _decode_rows(self, x: torch.Tensor, chosen: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:  # [nq, hidden] float32
        counts, rows, pair_weights = self._grouped(chosen, weights)
        return self.decode_experts(x.float().contiguous(), counts, rows.contiguous(),
                                   pair_weights.float().contiguous())


def stack_experts(model: nn.Module) -> None:
    """Every SparseMoE of `model` that has grouped experts on that path (stack_experts)."""
    for m in model.modules():
        if isinstance(m, SparseMoE) and m.grouped is not None:
            m.stack_experts()


# Mixtral's checkpoint names for its experts, as the rest of the decoder names them (Qwen's)
_MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_name(name: str) -> str:
    """A checkpoint's weight name with Mixtral's `block_sparse_moe.experts.E.w1` written as
    `mlp.experts.E.gate_proj` (w3: up_proj, w2: down_proj) and its router as `mlp.gate` (and
    GPT-OSS's `mlp.router`)."""
    if ".mlp.router." in name:
        return name.replace(".mlp.router.", ".mlp.gate.")
    if ".block_sparse_moe." not in name:
        return name
    parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
    if len(parts) >= 2 and parts[-2] in _MIXTRAL_EXPERT_NAMES and "experts" in parts:
        parts[-2] = _MIXTRAL_EXPERT_NAMES[parts[-2]]
    return ".".join(parts)


_GRANITE_MOE = ".block_sparse_moe."


def split_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """GraniteMoE's checkpoint tensors in the per-expert names the decoder uses:

        block_sparse_moe.input_linear.weight   [E, 2 * width, hidden]: gate rows, then up's
        block_sparse_moe.output_linear.weight  [E, hidden, width]: each expert's down_proj
        block_sparse_moe.router.layer.weight   [E, hidden]: the router (mlp.gate)"""
    for name, w in weights:
        stem, _, kind = name.rpartition(_GRANITE_MOE)
        at = f"{stem}.mlp.experts"
        if kind == "input_linear.weight":
            gate, up = w.chunk(2, dim=1)
            for e in range(w.shape[0]):
                yield f"{at}.{e}.gate_proj.weight", gate[e]
                yield f"{at}.{e}.up_proj.weight", up[e]
        elif kind == "output_linear.weight":
            for e in range(w.shape[0]):
                yield f"{at}.{e}.down_proj.weight", w[e]
        elif kind == "router.layer.weight":
            yield f"{stem}.mlp.gate.weight", w
        else:
            yield name, w


def split_fused_experts(weights: Iterable[tuple[str, torch.Tensor]],
                        skip: Set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-OSS's checkpoint tensors with each layer's experts as one matrix per expert, in the
    per-expert names the rest of the decoder uses (`mlp.experts.E.gate_proj.weight`, ...):

        mlp.experts.gate_up_proj       [E, hidden, 2 * width], gate and up columns interleaved
        mlp.experts.gate_up_proj_bias  [E, 2 * width], likewise
        mlp.experts.down_proj          [E, width, hidden];  down_proj_bias [E, hidden]

    The released checkpoints hold gate_up_proj and down_proj in MXFP4 (`*_blocks` of packed
    4-bit values, `*_scales` of their power-of-two exponents): transformers' dequantizer
    expands each pair to the float tensor above once both have been read, unless every
    expert's matrix it holds is in `skip` (no dense copy: weights/hf_mxfp4.py)."""
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        base, _, kind = name.rpartition("_")
        if kind in ("blocks", "scales") and base.endswith(("experts.gate_up_proj",
                                                           "experts.down_proj")):
            pair = packed.setdefault(base, {})
            pair[kind] = w
            if len(pair) < 2:
                continue
            del packed[base]
            stem, _, fused = base.rpartition(".")
            parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
            if all(f"{stem}.{e}.{p}.weight" in skip
                   for e in range(pair["blocks"].shape[0]) for p in parts):
                continue
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            name, w = base, convert_moe_packed_tensors(pair["blocks"], pair["scales"],
                                                       dtype=torch.float32)
        if not name.endswith(_FUSED):
            yield name, w
            continue
        stem, _, kind = name.rpartition(".")
        for e in range(w.shape[0]):
            at = f"{stem}.{e}."
            if kind == "gate_up_proj":  # [hidden, 2 * width] -> two [width, hidden]
                yield at + "gate_proj.weight", w[e, :, 0::2].t()
                yield at + "up_proj.weight", w[e, :, 1::2].t()
            elif kind == "gate_up_proj_bias":
                yield at + "gate_proj.bias", w[e, 0::2]
                yield at + "up_proj.bias", w[e, 1::2]
            elif kind == "down_proj":  # [width, hidden] -> [hidden, width]
                yield at + "down_proj.weight", w[e].t()
            else:
                yield at + "down_proj.bias", w[e]
    if packed:
        raise ValueError(f"MXFP4 experts without both blocks and scales: {sorted(packed)}")


_FUSED = tuple(f"mlp.experts.{k}" for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                             "down_proj_bias"))
