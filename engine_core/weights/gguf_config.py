"""A GGUF's metadata as a Hugging Face config.json would state it, for
ModelConfig.from_hf_config: llama.cpp's keys per architecture (`{arch}.*`), its rope scaling
(YaRN's keys, LongRoPE's and Llama 3's factors as tensors), the experts of a mixture, and what
llama.cpp knows of a model without the file saying it. What config.json has no key for goes
under `gguf` (config.GGUF_FIELDS)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine_core.config import ModelConfig

if TYPE_CHECKING:
    from engine_core.weights.gguf_file import GGUFMetadata

ROPE_FREQS = "rope_freqs.weight"
# rope tensors, read into the config rather than the model: Llama 3's and LongRoPE's factors
ROPE_TENSORS = {ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight"}


def model_config(f: GGUFMetadata) -> ModelConfig:
    """ModelConfig from a GGUF's metadata, as llama.cpp writes it per architecture."""
    return ModelConfig.from_hf_config(hf_config(f), name=str(f.field("general.name", f.path.stem)))


def hf_config(f: GGUFMetadata) -> dict[str, Any]:
    """The file's metadata under config.json's keys for its architecture, plus `gguf`: the
    ModelConfig fields config.json cannot state (config.GGUF_FIELDS)."""
    a, arch = f.arch, f.architecture
    names = {t.name for t in f.reader.tensors}
    num_heads = int(f.field(f"{a}.attention.head_count"))
    hidden = int(f.field(f"{a}.embedding_length"))
    num_layers = int(f.field(f"{a}.block_count"))
    tokens = f.reader.fields.get("tokenizer.ggml.tokens")
    head_dim, rotary_dim = _head_dims(f, a, num_heads, hidden)
    # a window the file states applies whatever the architecture's name (from_hf_config's
    # `gguf`): llama.cpp writes a Mistral GGUF as `llama`, whose HF configs have no window;
    # which layers slide is llama.cpp's fixed pattern, the architecture's global_every
    window = f.field(f"{a}.attention.sliding_window")
    if window is not None and arch.post_norms:  # OLMo 3's windowed layers: which ones?
        raise ValueError(f"{f.path.name}: an OLMo GGUF with a sliding window (OLMo 3) is not "
                         "supported: its pattern of windowed layers is not in the file; serve "
                         "the Hugging Face folder")
    soft = {k: f.field(f"{a}.{k}_logit_softcapping") for k in ("attn", "final")}
    scale = f.field(f"{a}.attention.scale")
    eos, eot = f.field("tokenizer.ggml.eos_token_id"), f.field("tokenizer.ggml.eot_token_id")
    cfg = {
        "architectures": [arch.hf_classes[0]],
        "model_type": arch.hf_model_types[0],
        "vocab_size": f.field(f"{a}.vocab_size") or (len(tokens.data) if tokens else None),
        "hidden_size": hidden,
        "intermediate_size": int(f.field(f"{a}.feed_forward_length")
                                 or f.field(f"{a}.expert_feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(f.field(f"{a}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(f.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(f.field(f"{a}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(f, a, names),
        "max_position_embeddings": int(f.field(f"{a}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": f.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(x) for x in (eos, eot) if x is not None)),
        "sliding_window": None if window is None else int(window),
        "embedding_multiplier": f.field(f"{a}.embedding_scale"),  # (Granite's)
        "attention_multiplier": None if scale is None else float(scale),  # (Granite's)
        "residual_multiplier": float(f.field(f"{a}.residual_scale") or 1.0),
        "logits_scaling": float(f.field(f"{a}.logit_scale") or 1.0),
        "attn_logit_softcapping": float(soft["attn"]) if soft["attn"] else None,
        "final_logit_softcapping": float(soft["final"]) if soft["final"] else None,
    }
    # Gemma 2 27B scales attention by (hidden / heads) ** -0.5, not head_dim's, as its HF
    # config's query_pre_attn_scalar says; its GGUF does not, and llama.cpp knows it by the
    # 27B's 46 layers: so do we
    if scale is None and a == "gemma2" and num_layers == 46:
        cfg["query_pre_attn_scalar"] = hidden / num_heads
    experts, expert_fields = _experts(f, a, names, num_layers)
    cfg.update(experts)
    rope_freqs = next((t for t in f.reader.tensors if t.name == ROPE_FREQS), None)
    cfg["gguf"] = {
        "rope_freq_factors": None if rope_freqs is None else tuple(
            float(x) for x in _floats(rope_freqs)),
        "rotary_dim": rotary_dim,
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        # the file's norms already hold Gemma's + 1
        "norm_weight_offset": 0.0,
        "local_rope_theta": (arch.local_rope_theta
                             if window is not None and arch.global_every else None),
        **expert_fields,
    }
    return cfg


def _head_dims(f: GGUFMetadata, a: str, num_heads: int, hidden: int) -> tuple[int, int | None]:
    """(a head's width, its rotated width where rope turns only part of it: Phi-4-mini). The
    width: the file's key length, else the attention output's input width over the heads, else
    the rope's dimension count."""
    out_proj = next((t for t in f.reader.tensors if t.name == "blk.0.attn_output.weight"),
                    None)
    rope_dim = f.field(f"{a}.rope.dimension_count")
    head_dim = int(f.field(f"{a}.attention.key_length")
                   or (int(out_proj.shape[0]) // num_heads if out_proj is not None else None)
                   or rope_dim or hidden // num_heads)
    partial = rope_dim is not None and int(rope_dim) != head_dim
    return head_dim, int(rope_dim) if partial else None


def _rope_scaling(f: GGUFMetadata, a: str, names: set[str]) -> dict[str, Any] | None:
    """config.json's rope_scaling from llama.cpp's rope.scaling.* keys and LongRoPE's factor
    tensors; None: unscaled (Llama 3's rope_freqs factors go under `gguf`)."""
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
    if "rope_factors_long.weight" in names:  # LongRoPE (Phi-3 128k, Phi-3.5)
        scaling = _longrope(f, a, scaling)
    return scaling


def _floats(t: Any) -> Any:
    """A tensor's values as a flat float array, dequantized from its GGML type."""
    return dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(-1)


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
        out[f"{kind}_factor"] = [float(x) for x in _floats(tensors[f"rope_factors_{kind}.weight"])]
    original = f.field(f"{a}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{f.path.name}: LongRoPE factors without "
                         f"{a}.rope.scaling.original_context_length")
    out["original_max_position_embeddings"] = int(original)
    attn = f.field(f"{a}.rope.scaling.attn_factor")
    if attn is not None:
        out["attention_factor"] = float(attn)
    return {**(scaling or {}), **out}

def _experts(f: GGUFMetadata, a: str, names: set[str], num_layers: int
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The experts as llama.cpp writes them, as (config.json's keys, `gguf`'s fields): the
    counts, an expert's width (Mixtral's is feed_forward_length), the shared expert's, the
    layers without a router (Qwen's mlp_only_layers), and whether the router and the experts
    have biases (their tensors). Whether the chosen weights are renormalized is fixed per
    architecture in llama.cpp (Architecture.moe_norm_topk), unless the file says
    (expert_weights_norm)."""
    num = int(f.field(f"{a}.expert_count") or 0)
    if not num:
        return {}, {}
    if any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in names):
        raise ValueError(f"{f.path.name}: experts stored one tensor each (an early "
                         f"llama.cpp Mixtral conversion) are not supported; convert the "
                         f"model again with a current llama.cpp")
    norm = f.field(f"{a}.expert_weights_norm")
    return ({"num_experts": num,
             "num_experts_per_tok": int(f.field(f"{a}.expert_used_count")),
             "moe_intermediate_size": int(f.field(f"{a}.expert_feed_forward_length")
                                          or f.field(f"{a}.feed_forward_length")),
             "norm_topk_prob": f.architecture.moe_norm_topk if norm is None else bool(norm),
             "shared_expert_intermediate_size": int(
                 f.field(f"{a}.expert_shared_feed_forward_length") or 0),
             "mlp_only_layers": [i for i in range(num_layers)
                                 if f"blk.{i}.ffn_gate_inp.weight" not in names]},
            {"router_bias": "blk.0.ffn_gate_inp.bias" in names,
             "expert_bias": "blk.0.ffn_gate_exps.bias" in names})
