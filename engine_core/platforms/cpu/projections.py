"""The projections of a decoder model that the CPU's decode rows multiply in their own form
(decode_quant.py), each with the Hugging Face names of its parts, as the weight loaders
(weights.py, a GGUF's blocks) name them."""

from __future__ import annotations

from collections.abc import Set

from torch import nn

from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model.feed_forward import SparseMoE


def mlps_of(layer, at: str) -> list[tuple[nn.Module, str]]:
    """A layer's gated MLPs with their checkpoint name prefixes (under `at`, the layer's
    `...mlp`): the MLP itself, or a SparseMoE's experts and its shared expert."""
    mlp = layer.mlp
    if not isinstance(mlp, SparseMoE):
        return [(mlp, at)]
    out = [(expert, f"{at}.experts.{e}") for e, expert in enumerate(mlp.experts)]
    if mlp.shared_expert is not None:
        out.append((mlp.shared_expert, f"{at}.shared_expert"))
    return out


def projections(model: DecoderForCausalLM,
                in_file: Set[str] = frozenset()) -> dict[tuple[nn.Module, str], list[str]]:
    """Every projection of the decoder layers, (module, attribute) -> the Hugging Face names of
    its parts: q/k/v for qkv_proj, gate/up for gate_up_proj (an MLP's, or each expert's and the
    shared expert's; a MoE's router stays dense), or the fused matrix itself where `in_file`
    (the names a GGUF has) holds it (Phi-3's attn_qkv)."""
    out = {}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        attn = layer.self_attn
        names = {
            (attn, "qkv_proj"): [f"{pre}self_attn.{p}_proj.weight" for p in "qkv"],
            (attn, "o_proj"): [f"{pre}self_attn.o_proj.weight"],
        }
        for mlp, at in mlps_of(layer, f"{pre}mlp"):
            names[(mlp, "gate_up_proj")] = [f"{at}.gate_proj.weight", f"{at}.up_proj.weight"]
            names[(mlp, "down_proj")] = [f"{at}.down_proj.weight"]
        for (module, attr), parts in names.items():
            whole = parts[0].rsplit(".", 2)[0] + f".{attr}.weight"
            out[(module, attr)] = [whole] if whole in in_file else parts
    return out
