"""The tiny random models of every architecture the registry knows, as transformers configs
with the overrides that put each one's features in play, and the check of our engine against
transformers on them (test_architectures.py and the tests beside it)."""

from __future__ import annotations

import pytest

from tests.engine_core import tiny_models as tm

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 10000.0}
# Qwen's long-context recipe on a 32-token original context: prompts of 70 tokens and 48
# more generated run past it; max_position_embeddings is the stretched length, as
# transformers expects
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
             "rope_theta": 10000.0}
CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-tied": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama3-rope": (transformers.LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "qwen2-yarn": (transformers.Qwen2Config, {"rope_parameters": YARN_ROPE,
                                              "max_position_embeddings": 128}),
    # local/global/local (transformers' default pattern: every other layer global), both soft
    # caps far below the scores' and logits' spread here, so that they change every output
    "gemma2": (transformers.Gemma2Config, {
        "num_hidden_layers": 3, "sliding_window": 12, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0}),
    # four layers, the fourth without rope (SmolLM3's every 4th)
    "smollm3": (transformers.SmolLM3Config, {"num_hidden_layers": 4, "pad_token_id": 0,
                                             "bos_token_id": 1, "eos_token_id": 2}),
    # fused qkv_proj and gate_up_proj; a window on every layer, as Phi-3-mini's 2047
    "phi3": (transformers.Phi3Config, {"sliding_window": 12, "pad_token_id": 0,
                                       "eos_token_id": 2}),
    # Granite's four multipliers, each far from 1 so that each changes every output
    "granite": (transformers.GraniteConfig, {
        "embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
        "logits_scaling": 3.0}),
    # OLMo 2: norms after the attention and the MLP only, q and k normed across heads;
    # OLMo 3 adds windowed layers whose rope stays unscaled where the global layers' is YaRN
    "olmo2": (transformers.Olmo2Config, {}),
    "olmo3": (transformers.Olmo3Config, {
        "num_hidden_layers": 3, "sliding_window": 12, "max_position_embeddings": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {**YARN_ROPE, "rope_theta": 5000.0},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 5000.0}}}),
    # EXAONE 4: post-norms, per-head q/k norms, windowed/windowed/windowed/global, the global
    # layer without rope
    "exaone4": (transformers.Exaone4Config, {
        "num_hidden_layers": 4, "sliding_window": 12,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    # GLM-4: four norms under its own names, rope over half of each head in interleaved pairs
    "glm4": (transformers.Glm4Config, {"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}),
    # GraniteMoE: Granite's multipliers (each far from 1) on Mixtral's layer, 4 experts, 2 each
    "granitemoe": (transformers.GraniteMoeConfig, {
        "num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 2.0,
        "attention_multiplier": 0.2, "residual_multiplier": 0.5, "logits_scaling": 3.0,
        "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}),
    # ERNIE 4.5: Llama with rope over the whole head in interleaved pairs
    "ernie4_5": (transformers.Ernie4_5Config, {"pad_token_id": 0, "eos_token_id": 2,
                                               "bos_token_id": 1}),
    # Seed-OSS: Llama with q/k/v biases, and o_proj's where attention_out_bias says so
    "seed-oss": (transformers.SeedOssConfig, {"attention_out_bias": True}),
    # OLMoE: OLMo's q/k norms on Llama's layer, 4 experts, 2 per token, not renormalized
    "olmoe": (transformers.OlmoeConfig, {"num_experts": 4, "num_experts_per_tok": 2}),
    # mixtures of experts: 4 experts, 2 per token; Mixtral's as wide as intermediate_size,
    # Qwen2-MoE's with a gated shared expert, Qwen3-MoE's first layer a dense MLP
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                             "sliding_window": None}),
    "qwen2-moe": (transformers.Qwen2MoeConfig, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64}),
    "qwen3-moe": (transformers.Qwen3MoeConfig, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [0]}),
    # GPT-OSS: windowed and global layers, 4 experts of which 2 per token, attention sinks,
    # its YaRN (truncate off) stretching a 32-token original context 8 times
    "gpt-oss": (transformers.GptOssConfig, {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 12,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                            "original_max_position_embeddings": 32}}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {}),
    "mistral-window": (transformers.MistralConfig, {"sliding_window": 12}),
    "mistral-global": (transformers.MistralConfig, {"sliding_window": None}),
    # local (windowed, rope base 10000) and global (rope base 1e6) layers interleaved;
    # query_pre_attn_scalar apart from head_dim so that its scale is in play
    "gemma3": (transformers.Gemma3TextConfig, {
        "num_hidden_layers": 3, "sliding_window": 12, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # Gemma 3 270M's attention shape: head_dim 256, one KV head (the C kernel's widest)
    "gemma3-mqa": (transformers.Gemma3TextConfig, {
        "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 12,
        "query_pre_attn_scalar": 256, "layer_types": ["sliding_attention", "full_attention"]}),
}
# what a llama.cpp Gemma 3 GGUF can say: every 6th layer global, attention scaled by head_dim
GEMMA3_AS_GGUF = {"num_hidden_layers": 6, "sliding_window": 12,
                  "query_pre_attn_scalar": tm.SIZES["head_dim"]}
# prompt lengths: short, longer than the 12-token window, several windows and blocks long
LENGTHS = [5, 19, 70]


def check_against_hf(hf, path, vocab: int = tm.SIZES["vocab_size"], device: str = "cpu") -> None:
    """Our engine on `device` against transformers on the host (float32 both)."""
    prompts = tm.prompts(vocab, LENGTHS)
    # a fourth prompt shares the third's first 64 tokens: a prefix-cache hit once it is cached
    prompts.append(prompts[2][:64] + prompts[0])
    # a 16-token budget chunks every prompt longer than 16 (the prefill chunks attend over
    # earlier chunks' KV, across the window)
    # the engine's defaults (quantize_decode None): float weights are computed as loaded
    eng = tm.engine(path, max_num_batched_tokens=16, device=device, quantize_decode=None)
    for p in prompts[1:3]:
        rel = tm.relative_error(tm.prompt_logits(eng, p), tm.hf_logits(hf, p))
        assert rel < 1e-3, f"logits differ by {rel:.2e} (prompt of {len(p)})"
    ours = tm.greedy(eng, prompts[:3], 48)
    ours += tm.greedy(eng, prompts[3:], 48)  # after the third finished: its blocks are cached
    for p, got in zip(prompts, ours, strict=True):
        assert got == tm.hf_greedy(hf, p, 48), f"greedy differs for a prompt of {len(p)}"
