"""OLMo 2, OLMo 3, OLMoE, EXAONE 4 and Seed-OSS beyond the shared architecture checks
(test_architectures.py): what their configs say, and what is refused."""

from __future__ import annotations

import pytest

from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import CASES

transformers = pytest.importorskip("transformers")


def test_olmo_configs_and_an_olmo3_gguf_refused(tmp_path):
    """OLMo 2 and 3 from their configs: post-norms, q and k normed across heads, OLMo 3's
    windowed layers with their own (unscaled) rope; an OLMo GGUF that states a window (OLMo
    3's, whose pattern of windowed layers llama.cpp's file does not hold) is refused, and so
    is a config that clamps q, k and v (clip_qkv)."""
    from engine_core.weights.gguf_loader import GGUFFile
    from engine_core.weights.safetensors_loader import load_hf_config

    for case in ("olmo2", "olmo3"):
        config_cls, overrides = CASES[case]
        hf = tm.build_hf(config_cls, tmp_path / case, **overrides)
        cfg = load_hf_config(tmp_path / case)
        assert (cfg.post_norms, cfg.qk_norm_whole, cfg.qk_norm) == (True, True, True)
    assert [cfg.layer_window(i) for i in range(3)] == [12, None, 12]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["rope_type"]) == (
        5000.0, 5000.0, "yarn")
    # the case tells them apart: the same weights with YaRN on every layer answer otherwise
    yarn = overrides["rope_parameters"]["full_attention"]
    everywhere = tm.build_hf(config_cls, tmp_path / "yarn", **{**overrides, "rope_parameters": {
        "full_attention": yarn, "sliding_attention": yarn}})
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    assert tm.relative_error(tm.hf_logits(everywhere, prompt), tm.hf_logits(hf, prompt)) > 0.01
    tm.write_gguf(hf, tmp_path / "w.gguf", arch="olmo2", permute=False,
                  extra={"olmo2.attention.sliding_window": 12})
    with pytest.raises(ValueError, match="OLMo GGUF with a sliding window"):
        GGUFFile(tmp_path / "w.gguf").model_config()
    from engine_core.config import ModelConfig  # OLMo 1's and some OLMoE's clamp: refused

    clamped = transformers.OlmoeConfig(**{**tm.SIZES, "clip_qkv": 8.0}).to_dict()
    with pytest.raises(ValueError, match=r"clip_qkv = 8.0 \(q, k and v clamped\)"):
        ModelConfig.from_hf_config({**clamped, "architectures": ["OlmoeForCausalLM"]}, "m")


def test_exaone4_windows_and_nope_global_layers(tmp_path):
    """EXAONE 4: post-norms with per-head q/k norms; its global layers rotate nothing where the
    model has windowed ones (the tiny case's logits move by 0.11 if they do), from
    layer_types, from an older config's "LLLG" pattern; without a window (the 1.2B), every
    layer is global and rotates. Its GGUF is refused by name."""
    from engine_core.config import ModelConfig
    from engine_core.weights.gguf_loader import GGUFFile

    config_cls, overrides = CASES["exaone4"]
    base = {**config_cls(**{**tm.SIZES, **overrides}).to_dict(),
            "architectures": ["Exaone4ForCausalLM"]}
    cfg = ModelConfig.from_hf_config(base, "e")
    assert (cfg.post_norms, cfg.qk_norm, cfg.qk_norm_whole) == (True, True, False)
    assert cfg.sliding_layers == cfg.rope_layers == (True, True, True, False)
    older = {k: v for k, v in base.items() if k != "layer_types"}
    for pattern in ("LLLG", 4):
        cfg = ModelConfig.from_hf_config({**older, "sliding_window_pattern": pattern}, "e")
        assert cfg.sliding_layers == cfg.rope_layers == (True, True, True, False)
    cfg = ModelConfig.from_hf_config({**older, "sliding_window": None}, "e")
    assert (cfg.sliding_window, cfg.rope_layers) == (None, None)
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    tm.write_gguf(hf, tmp_path / "m.gguf", arch="exaone4", permute=False)
    with pytest.raises(ValueError, match="'exaone4' is served from its Hugging Face folder "
                                         "only"):
        GGUFFile(tmp_path / "m.gguf")


def test_seed_oss_biases_and_what_is_refused():
    """Seed-OSS: q/k/v biases always, o_proj's where attention_out_bias says so; a config
    asking for MLP biases (mlp_bias; ERNIE 4.5's use_bias) is refused by name, as for Llama."""
    from engine_core.config import ModelConfig

    config_cls, _ = CASES["seed-oss"]
    for out_bias in (False, True):
        cfg = config_cls(**{**tm.SIZES, "attention_out_bias": out_bias}).to_dict()
        got = ModelConfig.from_hf_config({**cfg, "architectures": ["SeedOssForCausalLM"]}, "s")
        assert (got.attention_bias, got.o_bias) == (True, out_bias)
    for cls, arch, key in ((config_cls, "SeedOssForCausalLM", "mlp_bias"),
                           (transformers.LlamaConfig, "LlamaForCausalLM", "mlp_bias"),
                           (transformers.Ernie4_5Config, "Ernie4_5ForCausalLM", "use_bias")):
        cfg = {**cls(**{**tm.SIZES, key: True}).to_dict(), "architectures": [arch]}
        with pytest.raises(ValueError, match=f"{key} .* is not supported"):
            ModelConfig.from_hf_config(cfg, "m")
