"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) beyond the float32 comparison every
architecture gets in test_architectures.py: decode rows through quantized experts beside
prefill rows in one step, and experts as llama.cpp stores them in a GGUF."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import CASES, check_against_hf


@pytest.mark.parametrize("case", ["qwen2-moe", "mixtral", "gpt-oss"])
def test_experts_decode_quantized_whatever_shares_the_step(case, tmp_path):
    """Each expert runs once per step on its tokens in row order, so the decode rows among
    them take its quantized matmuls and the prefill rows its dense ones: a request's tokens
    are the same alone and in steps shared with other requests' prefill chunks (a 16-token
    budget chunks the longer prompts beside the shorter ones' decodes). The router and the
    shared expert's gate stay dense; every expert's matrices are quantized."""
    from torch import nn

    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    eng = tm.engine(tmp_path, quantize_decode=True, decode_activations="float32",
                    max_num_batched_tokens=16, quantization="int8")
    moe = eng.model.layers[0].mlp
    assert isinstance(moe.gate, nn.Linear)
    assert all(type(e.gate_up_proj).__name__ == "DecodeQuantLinear"
               and type(e.down_proj).__name__ == "DecodeQuantLinear" for e in moe.experts)
    # one layer's experts on 3 decode rows and 5 prefill rows: each row as it would be alone,
    # with the decode rows' experts in one C call and in module calls (the torch fallback)
    from engine_core.model.forward_context import ForwardContext, use

    x = torch.randn(8, tm.SIZES["hidden_size"], generator=torch.Generator().manual_seed(1))
    c_native = moe.decode_experts
    assert c_native is not None  # every expert's matrices are the C kernels'
    outs = {}
    for path, native in (("C", c_native), ("modules", None)):
        moe.decode_experts = native
        with torch.inference_mode():
            with use(ForwardContext(num_quant_rows=3)):
                mixed, decoded = moe(x), moe(x[:3])
            dense = moe(x[3:])
        torch.testing.assert_close(mixed[:3], decoded, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mixed[3:], dense, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(decoded, moe(x[:3]), rtol=1e-5, atol=1e-6)  # quantized
        outs[path] = decoded
    moe.decode_experts = c_native
    torch.testing.assert_close(outs["C"], outs["modules"], rtol=1e-4, atol=1e-4)
    prompts = tm.prompts(tm.SIZES["vocab_size"], [9, 40, 70])
    together = tm.greedy(eng, prompts, 12)
    alone = [tm.greedy(eng, [p], 12)[0] for p in prompts]
    assert together == alone
    for p, got in zip(prompts, together, strict=True):
        assert got[:2] == tm.hf_greedy(hf, p, 2)


@pytest.mark.parametrize(("case", "arch", "permute"), [
    ("mixtral", "llama", True), ("qwen2-moe", "qwen2moe", False),
    ("qwen3-moe", "qwen3moe", False), ("olmoe", "olmoe", False)])
def test_gguf_mixture_of_experts(case, arch, permute, tmp_path):
    """Experts as llama.cpp writes them: one 3-D tensor per matrix kind (ffn_gate_exps, ...),
    the router as ffn_gate_inp, Qwen2-MoE's shared expert and its gate vector, Mixtral under
    `llama`; logits and greedy equal to transformers in float32, and on the CPU defaults each
    expert decodes from the file's own Q4_0 blocks."""
    from gguf import GGMLQuantizationType

    from engine_core.weights.gguf_loader import GGUFFile

    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    tm.write_gguf(hf, tmp_path / "m.gguf", arch=arch, permute=permute)
    f = GGUFFile(tmp_path / "m.gguf")
    cfg = f.model_config()
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    # llama.cpp's choice per architecture
    assert cfg.norm_topk_prob == (case not in ("qwen2-moe", "olmoe"))
    assert cfg.moe_layers == ((False, True) if case == "qwen3-moe" else None)
    assert cfg.shared_expert_intermediate_size == (64 if case == "qwen2-moe" else 0)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in f.tensor_types()
    check_against_hf(hf, tmp_path / "m.gguf")
    if case == "mixtral":  # an early llama.cpp conversion: a tensor per expert, refused
        tm.write_gguf(hf, tmp_path / "old.gguf", arch=arch, extra_tensors={
            "blk.0.ffn_gate.0.weight": np.zeros((8, 8))})
        with pytest.raises(ValueError, match="experts stored one tensor each"):
            GGUFFile(tmp_path / "old.gguf").model_config()
    held = tm.write_gguf(hf, tmp_path / "q.gguf", arch=arch, permute=permute,
                         qtype=GGMLQuantizationType.Q4_0)
    tm.use_held_weights(hf, held)
    eng = tm.engine(tmp_path / "q.gguf", quantize_decode=True, decode_activations="float32")
    experts = eng.model.layers[1].mlp.experts
    assert all(type(e.gate_up_proj.quant).__name__ in ("NativeQ4Matmul", "Int4Matmul")
               for e in experts)  # the file's blocks, each expert its own rows
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    assert tm.relative_error(tm.prompt_logits(eng, prompt), tm.hf_logits(hf, prompt)) < 1e-3
    assert tm.greedy(eng, [prompt], 4)[0][:2] == tm.hf_greedy(hf, prompt, 2)


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss"])
def test_experts_in_the_one_call_c_decode_layers(case, tmp_path):
    """Where the C kernels load, a mixture of experts' decode rows go through all layers in one
    C call too (pd_decode_layers with each MoE layer's pd_moe: the router, top-k and the
    weights in C, the routed experts, Qwen2-MoE's gated shared expert; Qwen3-MoE's dense first
    layer as any MLP; GPT-OSS's sinks, biases and clamped SwiGLU), giving the tokens the
    layer-by-layer path gives with the same weights."""
    from engine_core.platforms.cpu.decode_quant import DecodeQuantization
    from kernels import native

    if native.load() is None:
        pytest.skip("the C kernels do not load here")
    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    eng = tm.engine(tmp_path, quantize_decode=True, max_num_batched_tokens=16,
                    quantization="int8")
    decode_layers = eng.runner.quantization.decode_layers
    assert decode_layers is not None
    moe_layers = [bool(layer.moe) for layer in decode_layers.layers]
    assert moe_layers == ([False, True] if case == "qwen3-moe" else [True, True])
    for layer, c_layer in zip(eng.model.layers, decode_layers.layers, strict=True):
        if c_layer.moe:
            moe = native.Moe.from_address(c_layer.moe)
            assert (moe.num_experts, moe.top_k, moe.norm_topk) == (4, 2, case != "qwen2-moe")
            assert moe.gate_up == ctypes.addressof(layer.mlp.decode_experts.gate_up)  # this layer's experts
            assert moe.shared_width == (64 if case == "qwen2-moe" else 0)
            assert bool(moe.router_bias) == (case == "gpt-oss")
            experts = native.Matrix * 4
            assert all(bool(m.bias) == (case == "gpt-oss")
                       for m in (*experts.from_address(moe.gate_up),
                                 *experts.from_address(moe.down)))
        oss = case == "gpt-oss"
        assert bool(c_layer.sinks) == bool(c_layer.o.bias) == oss
        assert (c_layer.act, c_layer.act_limit) == ((2, 7.0) if oss else (0, 7.0))
    prompts = tm.prompts(tm.SIZES["vocab_size"], [40, 9, 70])
    one_call = tm.greedy(eng, prompts, 24)  # the 70-token prompt prefills beside decodes
    for p, got in zip(prompts, one_call, strict=True):
        assert got[:2] == tm.hf_greedy(hf, p, 2)
    eng.runner.quantization = DecodeQuantization(decode_layers=None)  # layer by layer
    assert tm.greedy(eng, prompts, 24) == one_call
