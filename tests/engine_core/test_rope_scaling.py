"""Rope scaling and partial rotary against transformers: YaRN, LongRoPE (both factor sets),
Llama 3 as a GGUF's rope_freqs, Phi-4-mini's partial rotary; each on tiny random models, as
safetensors and as GGUF (arch_cases.py's helpers)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import (
    CASES,
    LLAMA3_ROPE,
    YARN_ROPE,
    check_against_hf,
)

transformers = pytest.importorskip("transformers")


def test_yarn_rope_as_transformers_computes_it(tmp_path):
    """YaRN's frequencies and attention factor against transformers' own rotary embedding,
    for a Qwen config as its model card writes it (max_position_embeddings at the original
    length: served up to factor times that, as vLLM derives it), with beta and mscale
    variants; and what YaRN cannot do without is a clear error before any weight is read."""
    from engine_core.config import ModelConfig
    from engine_core.model.rope import attention_factor, cos_sin_cache, inv_frequencies
    from engine_core.weights.safetensors_loader import load_hf_config

    for extra in ({}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"mscale": 0.707,
                                                            "mscale_all_dim": 1.0}):
        rope = {**YARN_ROPE, **extra}
        hf = tm.build_hf(transformers.Qwen2Config, tmp_path, rope_parameters=rope,
                         max_position_embeddings=128)
        rotary = hf.model.rotary_emb
        ours = inv_frequencies(16, 10000.0, rope)
        torch.testing.assert_close(ours.float(), rotary.inv_freq, rtol=1e-6, atol=0)
        assert attention_factor(rope) == pytest.approx(rotary.attention_scaling)
        assert not torch.allclose(ours, inv_frequencies(16, 10000.0, None))  # in play
        positions = torch.arange(100)[None]
        cos, sin = rotary(torch.zeros(1, 100, 16), positions)  # [1, 100, 16], halves repeated
        table = cos_sin_cache(16, 100, 10000.0, rope)
        torch.testing.assert_close(table[:, :8], cos[0, :, :8], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(table[:, 8:], sin[0, :, :8], rtol=1e-5, atol=1e-5)

    transformers.Qwen2Config(**{**tm.SIZES, "max_position_embeddings": 32768, "rope_parameters": {
        **YARN_ROPE, "original_max_position_embeddings": 32768}}).save_pretrained(tmp_path / "q")
    assert load_hf_config(tmp_path / "q").max_position_embeddings == 131072
    fields = dict(name="m", vocab_size=8, hidden_size=16, intermediate_size=16, num_layers=1,
                  num_heads=1, num_kv_heads=1, head_dim=16)
    for rope, message in [({"rope_type": "yarn", "factor": 4.0}, "original_max_position"),
                          ({"rope_type": "yarn", "original_max_position_embeddings": 8},
                           "needs a factor"),
                          ({"rope_type": "dynamic", "factor": 4.0},
                           "'dynamic' is not supported (linear, llama3, yarn, longrope)")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ModelConfig(**fields, rope_scaling=rope)


# Phi-3-mini-128k's recipe on a 32-token original context (128 served): per-frequency
# factors, long ones far from the short ones, so that the choice between them is in play
LONGROPE = {"rope_theta": 10000.0, "rope_type": "longrope",
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7],
            "long_factor": [1.0, 1.3, 1.9, 2.8, 4.1, 6.0, 8.2, 11.0]}
PHI3_LONG = {**CASES["phi3"][1], "sliding_window": None, "rope_parameters": LONGROPE,
             "original_max_position_embeddings": 32, "max_position_embeddings": 128}


def test_phi3_longrope_as_transformers_computes_it(tmp_path):
    """LongRoPE's tables against transformers' rotary embedding, both factor sets and the
    attention factor; an engine serving past the original context uses the long factors and
    matches transformers on prompts past it, one serving within it the short ones and
    matches on a prompt and continuation within it (transformers picks by the sequence)."""
    from engine_core.model.rope import attention_factor, cos_sin_cache
    from engine_core.weights.safetensors_loader import load_hf_config

    hf = tm.build_hf(transformers.Phi3Config, tmp_path, **PHI3_LONG)
    cfg = load_hf_config(tmp_path)
    assert cfg.rope_kind == "longrope" and cfg.max_position_embeddings == 128
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32
    rotary = hf.model.rotary_emb
    assert attention_factor(cfg.rope_scaling, 128) == pytest.approx(rotary.attention_scaling)
    assert attention_factor(cfg.rope_scaling, 128) == pytest.approx(math.sqrt(1 + math.log(4) /
                                                                               math.log(32)))
    for last, long in ((100, True), (20, False)):  # transformers picks by max(position) + 1
        cos, sin = rotary(torch.zeros(1, last + 1, 16), torch.arange(last + 1)[None])
        table = cos_sin_cache(16, last + 1, 10000.0, cfg.rope_scaling, long=long)
        table = table * attention_factor(cfg.rope_scaling, 128) / attention_factor(
            cfg.rope_scaling, last + 1)  # the factor follows the model's context, not `last`
        torch.testing.assert_close(table[:, :8], cos[0, :, :8], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(table[:, 8:], sin[0, :, :8], rtol=1e-5, atol=1e-5)

    long_eng = tm.engine(tmp_path)  # serves 128 > 32: the long factors
    for p in tm.prompts(tm.SIZES["vocab_size"], [40, 70]):
        assert tm.relative_error(tm.prompt_logits(long_eng, p), tm.hf_logits(hf, p)) < 1e-3
        assert tm.greedy(long_eng, [p], 24)[0] == tm.hf_greedy(hf, p, 24)
    short_eng = tm.engine(tmp_path, max_model_len=32)  # within the original: the short ones
    p = tm.prompts(tm.SIZES["vocab_size"], [12])[0]
    assert tm.relative_error(tm.prompt_logits(short_eng, p), tm.hf_logits(hf, p)) < 1e-3
    assert tm.greedy(short_eng, [p], 16)[0] == tm.hf_greedy(hf, p, 16)
    assert tm.relative_error(tm.prompt_logits(long_eng, p), tm.hf_logits(hf, p)) > 1e-3


def test_phi4_mini_partial_rotary(tmp_path):
    """Phi-4-mini's partial rotary (rope over the first 3/4 of each head; here half of 16
    dims, with LongRoPE's factors over those 8): q and k rows reordered at load so that
    rotate_half pairs the dimensions the model's rope pairs, the rest unrotated. Against
    transformers as safetensors and as a GGUF (rope.dimension_count 8), in float32 and on the
    CPU defaults (a Q4_0 file's fused qkv blocks reordered alike, in one C call per step)."""
    from gguf import GGMLQuantizationType

    from engine_core.weights.gguf_loader import GGUFFile
    from engine_core.weights.safetensors_loader import load_hf_config

    rope = {**LONGROPE, "partial_rotary_factor": 0.5, "short_factor": LONGROPE["short_factor"][:4],
            "long_factor": LONGROPE["long_factor"][:4]}
    overrides = {**PHI3_LONG, "rope_parameters": rope}
    hf = tm.build_hf(transformers.Phi3Config, tmp_path / "hf", **overrides)
    assert load_hf_config(tmp_path / "hf").rotary_dim == 8
    check = tm.prompts(tm.SIZES["vocab_size"], [40, 70])
    eng = tm.engine(tmp_path / "hf")
    for p in check:
        assert tm.relative_error(tm.prompt_logits(eng, p), tm.hf_logits(hf, p)) < 1e-3
        assert tm.greedy(eng, [p], 24)[0] == tm.hf_greedy(hf, p, 24)
    whole = tm.build_hf(transformers.Phi3Config, tmp_path / "whole", **{
        **PHI3_LONG, "rope_parameters": {**LONGROPE}})  # the same weights, rope over all 16
    assert tm.relative_error(tm.prompt_logits(eng, check[0]), tm.hf_logits(whole, check[0])) > 0.05

    factors = {f"rope_factors_{k}.weight": np.array(rope[f"{k}_factor"]) for k in ("long", "short")}
    keys = {"phi3.rope.dimension_count": 8, "phi3.rope.scaling.original_context_length": 32}
    tm.write_gguf(hf, tmp_path / "m.gguf", arch="phi3", permute=False, extra=keys,
                  extra_tensors=factors)
    assert GGUFFile(tmp_path / "m.gguf").model_config().rotary_dim == 8
    eng = tm.engine(tmp_path / "m.gguf")
    for p in check:
        assert tm.relative_error(tm.prompt_logits(eng, p), tm.hf_logits(hf, p)) < 1e-3
    held = tm.write_gguf(hf, tmp_path / "q.gguf", arch="phi3", permute=False, extra=keys,
                         extra_tensors=factors, qtype=GGMLQuantizationType.Q4_0)
    tm.use_held_weights(hf, held)
    eng = tm.engine(tmp_path / "q.gguf", quantize_decode=True, decode_activations="float32")
    assert type(eng.model.layers[0].self_attn.qkv_proj.quant).__name__ in (
        "NativeQ4Matmul", "Int4Matmul")
    assert tm.greedy(eng, [check[0]], 4)[0][:2] == tm.hf_greedy(hf, check[0], 2)


def test_gguf_phi3_longrope_as_llama_cpp_writes_it(tmp_path):
    """A Phi-3 128k GGUF: the factors as rope_factors_long/short tensors, the original
    context and the attention factor llama.cpp's converter computed as keys."""
    from engine_core.weights.gguf_loader import GGUFFile

    hf = tm.build_hf(transformers.Phi3Config, tmp_path / "hf", **PHI3_LONG)
    factors = {f"rope_factors_{k}.weight": np.array(LONGROPE[f"{k}_factor"])
               for k in ("long", "short")}
    keys = {"phi3.rope.scaling.original_context_length": 32,
            "phi3.rope.scaling.attn_factor": math.sqrt(1 + math.log(4) / math.log(32))}
    tm.write_gguf(hf, tmp_path / "m.gguf", arch="phi3", permute=False, extra=keys,
                  extra_tensors=factors)
    cfg = GGUFFile(tmp_path / "m.gguf").model_config()
    assert cfg.rope_kind == "longrope" and cfg.rope_scaling["long_factor"] == pytest.approx(
        LONGROPE["long_factor"])
    eng = tm.engine(tmp_path / "m.gguf")
    for p in tm.prompts(tm.SIZES["vocab_size"], [40, 70]):
        assert tm.relative_error(tm.prompt_logits(eng, p), tm.hf_logits(hf, p)) < 1e-3
        assert tm.greedy(eng, [p], 24)[0] == tm.hf_greedy(hf, p, 24)


def test_gguf_yarn_as_llama_cpp_writes_it(tmp_path):
    """A Qwen2 GGUF with YaRN's keys as llama.cpp's converter writes them (type, factor,
    original context length) matches transformers past the original context; an attention
    factor of its own, which llama.cpp and transformers read differently, is refused."""
    from engine_core.weights.gguf_loader import GGUFFile

    hf = tm.build_hf(transformers.Qwen2Config, tmp_path, rope_parameters=YARN_ROPE,
                     max_position_embeddings=128)
    keys = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32}
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    tm.write_gguf(hf, gguf_dir / "m.gguf", arch="qwen2", permute=False, extra=keys)
    assert GGUFFile(gguf_dir / "m.gguf").model_config().rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    check_against_hf(hf, gguf_dir / "m.gguf")
    tm.write_gguf(hf, tmp_path / "bad.gguf", arch="qwen2", permute=False,
                  extra={**keys, "qwen2.rope.scaling.attn_factor": 0.5})
    with pytest.raises(ValueError, match=r"qwen2.rope.scaling.attn_factor = 0.5 is not supported"):
        GGUFFile(tmp_path / "bad.gguf").model_config()


def test_gguf_llama3_rope_freqs_matches_transformers(tmp_path):
    """A Llama 3 GGUF as llama.cpp writes it: Q/K permuted, no rope_scaling metadata, the
    scaling as the rope_freqs tensor (base frequency / scaled frequency, taken here from
    transformers' own rotary embedding)."""
    hf = tm.build_hf(transformers.LlamaConfig, tmp_path, rope_parameters=LLAMA3_ROPE)
    head_dim = tm.SIZES["head_dim"]
    base = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factors = base / hf.model.rotary_emb.inv_freq.double().numpy()
    assert factors.max() > 7.9 and factors.min() == pytest.approx(1.0)  # scaling is in play
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    tm.write_gguf(hf, gguf_dir / "m.gguf", rope_freqs=factors)
    check_against_hf(hf, gguf_dir / "m.gguf")
