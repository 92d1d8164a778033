"""A GGUF's metadata as our ModelConfig: llama.cpp's keys per architecture (`{arch}.*`), its
rope scaling (YaRN's keys, LongRoPE's and Llama 3's factors as tensors), the experts of a
mixture, and what llama.cpp knows of a model without the file saying it."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine_core.config import ModelConfig
from engine_core.model.rope_scaling import served_positions

if TYPE_CHECKING:
    from engine_core.weights.gguf_file import GGUFMetadata

ROPE_FREQS = "rope_freqs.weight"
# rope tensors, read into the config rather than the model: Llama 3's and LongRoPE's factors
ROPE_TENSORS = {ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight"}


def model_config(f: GGUFMetadata) -> ModelConfig:
    """ModelConfig from a GGUF's metadata, as llama.cpp writes it per architecture."""
    a = f.arch
    names = {t.name for t in f.reader.tensors}
    num_heads = int(f.field(f"{a}.attention.head_count"))
    hidden = int(f.field(f"{a}.embedding_length"))
    tokens = f.reader.fields.get("tokenizer.ggml.tokens")
    vocab = f.field(f"{a}.vocab_size") or (len(tokens.data) if tokens else None)
    scaling = None
    scaling_type = f.field(f"{a}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling = {
            "rope_type": scaling_type,
            "factor": float(f.field(f"{a}.rope.scaling.factor", 1.0)),
        }
        if scaling_type == "yarn":
            scaling.update(_yarn_fields(f, a))
            if not f.architecture.yarn_truncate:
                scaling["truncate"] = False
    # a head's width: the file's key length, else the attention output's input width over
    # the heads (the rope's dimension count is narrower under partial rotary: refused)
    out_proj = next((t for t in f.reader.tensors if t.name == "blk.0.attn_output.weight"),
                    None)
    rope_dim = f.field(f"{a}.rope.dimension_count")
    head_dim = int(f.field(f"{a}.attention.key_length")
                   or (int(out_proj.shape[0]) // num_heads if out_proj is not None else None)
                   or rope_dim or hidden // num_heads)
    rotary_dim = None
    if rope_dim is not None and int(rope_dim) != head_dim:  # partial rotary (Phi-4-mini)
        rotary_dim = int(rope_dim)
    if "rope_factors_long.weight" in names:  # LongRoPE (Phi-3 128k, Phi-3.5)
        scaling = _longrope(f, a, scaling)
    factors = None
    rope_freqs = next((t for t in f.reader.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        factors = tuple(float(x) for x in dequantize(
            rope_freqs.data, GGMLQuantizationType(rope_freqs.tensor_type)).reshape(-1))
    arch = f.architecture
    num_layers = int(f.field(f"{a}.block_count"))
    # a window the file states applies whatever the architecture's name: llama.cpp writes
    # a Mistral GGUF as `llama`, whose HF configs have no window
    window = f.field(f"{a}.attention.sliding_window")
    if window is not None and arch.post_norms:  # OLMo 3's windowed layers: which ones?
        raise ValueError(f"{f.path.name}: an OLMo GGUF with a sliding window (OLMo 3) is not "
                         "supported: its pattern of windowed layers is not in the file; serve "
                         "the Hugging Face folder")
    sliding = None
    if window is not None and arch.global_every:
        every = arch.global_every
        sliding = tuple((i + 1) % every != 0 for i in range(num_layers))
    soft = {k: f.field(f"{a}.{k}_logit_softcapping") for k in ("attn", "final")}
    # Gemma 2 27B scales attention by (hidden / heads) ** -0.5, not head_dim's; its GGUF
    # does not say so, and llama.cpp knows it by the 27B's 46 layers: so do we
    scale = f.field(f"{a}.attention.scale")
    if scale is None and a == "gemma2" and num_layers == 46:
        scale = (hidden / num_heads) ** -0.5
    experts = _experts(f, a, names, num_layers)
    eos = f.field("tokenizer.ggml.eos_token_id")
    eot = f.field("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    return ModelConfig(
        name=str(f.field("general.name", f.path.stem)),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f.field(f"{a}.feed_forward_length")
                              or f.field(f"{a}.expert_feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(f.field(f"{a}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(f.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f.field(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=served_positions(
            int(f.field(f"{a}.context_length", 2048)), scaling),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=f.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=f.architecture.name,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=None if window is None else int(window),
        attention_scale=None if scale is None else float(scale),
        attn_softcap=float(soft["attn"]) if soft["attn"] else None,
        final_softcap=float(soft["final"]) if soft["final"] else None,
        sliding_layers=sliding,
        rope_freq_factors=factors,
        # the file's norms already hold Gemma's + 1: no norm_weight_offset
        local_rope_theta=arch.local_rope_theta if sliding else None,
        rope_layers=(tuple((i + 1) % arch.nope_every != 0 for i in range(num_layers))
                     if arch.nope_every else None),
        rotary_dim=rotary_dim,
        sandwich_norms=arch.sandwich_norms,
        post_norms=arch.post_norms,
        qk_norm_whole=arch.qk_norm_whole,
        embedding_scale=(hidden**0.5 if arch.embedding_scale
                         else f.field(f"{a}.embedding_scale")),  # (Granite's)
        residual_multiplier=float(f.field(f"{a}.residual_scale") or 1.0),
        logits_scaling=float(f.field(f"{a}.logit_scale") or 1.0),
        hidden_act=arch.activation,
        o_bias=arch.o_bias,
        attention_sinks=arch.attention_sinks,
        **experts,
    )

def _yarn_fields(f: GGUFMetadata, a: str) -> dict[str, Any]:
    """YaRN's keys as llama.cpp writes them, under transformers' names. Its attention factor
    is refused where the file states one: llama.cpp multiplies it into YaRN's own, where
    transformers' replaces it."""
    out: dict[str, Any] = {}
    original = f.field(f"{a}.rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = f.field(f"{a}.rope.scaling.{key}")
        if value is not None:
            out[name] = float(value)
    for key in ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier"):
        value = f.field(f"{a}.rope.scaling.{key}")
        if value is not None and float(value) != (0.0 if key == "yarn_log_multiplier"
                                                  else 1.0):
            raise ValueError(f"{f.path.name}: {a}.rope.scaling.{key} = {value} is not "
                             f"supported (YaRN with its own attention factor only)")
    return out

def _longrope(f: GGUFMetadata, a: str, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """LongRoPE as llama.cpp's converter writes it: the factors as rope_factors_long and
    _short tensors, the original context, and the attention factor it computed."""
    tensors = {t.name: t for t in f.reader.tensors}
    out = {"rope_type": "longrope"}
    for kind in ("long", "short"):
        t = tensors[f"rope_factors_{kind}.weight"]
        out[f"{kind}_factor"] = [float(x) for x in dequantize(
            t.data, GGMLQuantizationType(t.tensor_type)).reshape(-1)]
    original = f.field(f"{a}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{f.path.name}: LongRoPE factors without "
                         f"{a}.rope.scaling.original_context_length")
    out["original_max_position_embeddings"] = int(original)
    attn = f.field(f"{a}.rope.scaling.attn_factor")
    if attn is not None:
        out["attention_factor"] = float(attn)
    return {**(scaling or {}), **out}

def _experts(f: GGUFMetadata, a: str, names: set[str], num_layers: int) -> dict[str, Any]:
    """ModelConfig's expert fields as llama.cpp writes them: the counts, an expert's width
    (Mixtral's is feed_forward_length), the shared expert's, and the layers with a router.
    Whether the chosen weights are renormalized is fixed per architecture in llama.cpp
    (Architecture.moe_norm_topk), unless the file says (expert_weights_norm)."""
    num = int(f.field(f"{a}.expert_count") or 0)
    if not num:
        return {}
    if any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in names):
        raise ValueError(f"{f.path.name}: experts stored one tensor each (an early "
                         f"llama.cpp Mixtral conversion) are not supported; convert the "
                         f"model again with a current llama.cpp")
    layers = tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(num_layers))
    norm = f.field(f"{a}.expert_weights_norm")
    return dict(num_experts=num, num_experts_per_tok=int(f.field(f"{a}.expert_used_count")),
                moe_intermediate_size=int(f.field(f"{a}.expert_feed_forward_length")
                                          or f.field(f"{a}.feed_forward_length")),
                norm_topk_prob=(f.architecture.moe_norm_topk if norm is None
                                else bool(norm)),
                shared_expert_intermediate_size=int(
                    f.field(f"{a}.expert_shared_feed_forward_length") or 0),
                moe_layers=None if all(layers) else layers,
                router_bias="blk.0.ffn_gate_inp.bias" in names,
                expert_bias="blk.0.ffn_gate_exps.bias" in names)
