"""A GGUF's ModelConfig (weights/gguf_config.py: its metadata under config.json's keys, then
ModelConfig.from_hf_config) against the one from_hf_config gives for the same tiny model's
Hugging Face folder: equal at float32 precision, up to what llama.cpp's file states otherwise
(as_gguf_states)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import CASES, GEMMA3_AS_GGUF, transformers
from tests.engine_core.test_gpt_oss import write_gpt_oss_gguf
from tests.engine_core.test_rope_scaling import LONGROPE, PHI3_LONG

_PARTIAL_LONGROPE = {**LONGROPE, "partial_rotary_factor": 0.5,
                     "short_factor": LONGROPE["short_factor"][:4],
                     "long_factor": LONGROPE["long_factor"][:4]}
_LONGROPE_ATTENTION = math.sqrt(1 + math.log(4) / math.log(32))  # factor 128 / 32
# case: (transformers config, overrides, GGUF architecture, extra keys, extra tensors); the
# overrides are what a llama.cpp file can state (Gemma 3's window pattern, Gemma 2's head_dim
# scale), the keys and tensors what its converter adds
GGUFS = {
    "llama": (*CASES["llama"], "llama", {}, {}),
    "llama-tied": (*CASES["llama-tied"], "llama", {}, {}),
    "mistral-window": (*CASES["mistral-window"], "llama",
                       {"llama.attention.sliding_window": 12}, {}),
    "qwen2": (*CASES["qwen2"], "qwen2", {}, {}),
    "qwen2-yarn": (*CASES["qwen2-yarn"], "qwen2", {
        "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32}, {}),
    "qwen3": (*CASES["qwen3"], "qwen3", {}, {}),
    "gemma2": (CASES["gemma2"][0], {**CASES["gemma2"][1],
                                    "query_pre_attn_scalar": tm.SIZES["head_dim"]}, "gemma2",
               {}, {}),
    # Gemma 2 27B's scale, (hidden / heads) ** -0.5, which llama.cpp knows by its 46 layers
    "gemma2-46": (CASES["gemma2"][0], {**CASES["gemma2"][1], "num_hidden_layers": 46,
                                       "hidden_size": 48, "query_pre_attn_scalar": 12},
                  "gemma2", {}, {}),
    "gemma3": (transformers.Gemma3TextConfig, GEMMA3_AS_GGUF, "gemma3", {}, {}),
    "smollm3": (*CASES["smollm3"], "smollm3", {}, {}),
    "phi3": (*CASES["phi3"], "phi3", {}, {}),
    # the attention factor llama.cpp's converter computes, stated in the config too
    "phi3-longrope": (transformers.Phi3Config, {**PHI3_LONG, "rope_parameters": {
        **LONGROPE, "attention_factor": _LONGROPE_ATTENTION}}, "phi3", {
        "phi3.rope.scaling.original_context_length": 32,
        "phi3.rope.scaling.attn_factor": _LONGROPE_ATTENTION}, {
        f"rope_factors_{k}.weight": np.array(LONGROPE[f"{k}_factor"]) for k in ("long", "short")}),
    # Phi-4-mini's partial rotary: rope over 8 of each head's 16 dimensions
    "phi3-partial": (transformers.Phi3Config, {**PHI3_LONG, "rope_parameters": _PARTIAL_LONGROPE},
                     "phi3", {"phi3.rope.dimension_count": 8,
                              "phi3.rope.scaling.original_context_length": 32}, {
        f"rope_factors_{k}.weight": np.array(_PARTIAL_LONGROPE[f"{k}_factor"])
        for k in ("long", "short")}),
    "granite": (*CASES["granite"], "granite", {
        "granite.embedding_scale": 2.0, "granite.attention.scale": 0.2,
        "granite.residual_scale": 0.5, "granite.logit_scale": 3.0}, {}),
    "olmo2": (*CASES["olmo2"], "olmo2", {}, {}),
    "mixtral": (*CASES["mixtral"], "llama", {}, {}),
    "qwen2-moe": (*CASES["qwen2-moe"], "qwen2moe", {}, {}),
    "qwen3-moe": (*CASES["qwen3-moe"], "qwen3moe", {}, {}),
    "olmoe": (*CASES["olmoe"], "olmoe", {}, {}),
    "gpt-oss": (*CASES["gpt-oss"], "gpt-oss", None, None),  # (test_gpt_oss's own writer)
}
# transformers' YaRN defaults, which a file need not state
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}


def as_gguf_states(cfg, gguf_arch: str):
    """The HF folder's ModelConfig as its llama.cpp GGUF states it: the architecture under
    llama.cpp's name (Mistral and Mixtral are `llama`), Gemma's norms holding their + 1
    (norm_weight_offset 0), the default attention scale unstated (None), YaRN's default betas
    unstated."""
    scaling = cfg.rope_scaling and {k: v for k, v in cfg.rope_scaling.items()
                                    if _YARN_DEFAULTS.get(k) != v}
    default_scale = cfg.attention_scale == cfg.head_dim ** -0.5
    return dataclasses.replace(
        cfg, architecture=gguf_arch, norm_weight_offset=0.0,
        attention_scale=None if default_scale else cfg.attention_scale, rope_scaling=scaling)


def at_float32(cfg) -> dict:
    """A ModelConfig's fields with every float rounded to float32, as a GGUF stores them."""
    def f32(x):
        if isinstance(x, float):
            return float(np.float32(x))
        if isinstance(x, (list, tuple)):
            return type(x)(f32(v) for v in x)
        return {k: f32(v) for k, v in x.items()} if isinstance(x, dict) else x
    return {f.name: f32(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


@pytest.mark.parametrize("case", GGUFS)
def test_gguf_config_is_the_hf_configs(case, tmp_path):
    from engine_core.weights.gguf_file import GGUFMetadata
    from engine_core.weights.safetensors_loader import load_hf_config

    config_cls, overrides, arch, keys, tensors = GGUFS[case]
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    path = tmp_path / "m.gguf"
    if arch == "gpt-oss":
        write_gpt_oss_gguf(hf, path)
    else:
        tm.write_gguf(hf, path, arch=arch, permute=False, extra=keys, extra_tensors=tensors)
    got = GGUFMetadata(path).model_config()
    want = as_gguf_states(load_hf_config(tmp_path), arch)
    assert at_float32(got) == at_float32(dataclasses.replace(want, name=got.name))


def test_llama3_rope_freqs_and_what_from_hf_config_refuses():
    """The `gguf` key's fields are taken as given (Llama 3's rope_freqs factors, which no
    config.json key holds); a key outside GGUF_FIELDS is refused."""
    from engine_core.config import GGUF_FIELDS, ModelConfig

    base = {**tm.SIZES, "architectures": ["LlamaForCausalLM"]}
    factors = tuple(float(x) for x in np.linspace(1.0, 8.0, tm.SIZES["head_dim"] // 2))
    cfg = ModelConfig.from_hf_config({**base, "gguf": {"rope_freq_factors": factors}}, "m")
    assert cfg.rope_freq_factors == factors and "rope_freq_factors" in GGUF_FIELDS
    with pytest.raises(ValueError, match=r"gguf holds \['hidden_size'\]"):
        ModelConfig.from_hf_config({**base, "gguf": {"hidden_size": 32}}, "m")
