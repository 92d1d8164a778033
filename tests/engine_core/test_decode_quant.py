"""Decode rows on weight-only 4/8-bit matmuls (engine_core/platforms/cpu/decode_quant.py), real model."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from test_real_model import PROMPTS, assert_batched_equals_solo  # same folder (rootdir import)

from engine_core.model.forward_context import ForwardContext, use
from engine_core.platforms.cpu.decode_quant import (
    REFINE_TOP_K,
    DecodeQuantization,
    DecodeQuantLinear,
    DecodeQuantLMHead,
    Int4Matmul,
    Int8Matmul,
    requantize_int4,
)
from engine_core.sampling_params import SamplingParams
from engine_core.weights.gguf_loader import GGUFFile
from kernels import native
from tests.native_kernels import require_native_kernels

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm_quant(model_path):
    """Decode rows on the C kernels (kernels/native.py) where they build, as served here."""
    from engine_core.llm import LLM

    return LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25, quantize_decode=True)


@pytest.fixture(scope="module")
def llm_quant_bf16(model_path):
    """A bf16 model (the CPU default where bf16 is native): decode attention in C over the bf16
    cache, RMSNorms in C with the bf16 reference's roundings."""
    from engine_core.llm import LLM

    llm = LLM(str(model_path), dtype="bfloat16", kv_cache_memory_gb=0.25, quantize_decode=True)
    layer = llm.engine.model.layers[0]
    assert (layer.self_attn.row_attention is not None) == (native.load() is not None)
    assert (layer.input_layernorm.fused is not None) == (native.load() is not None)
    return llm


@pytest.fixture(scope="module")
def llm_quant_int8(model_path):
    """Decode matmuls on int8 activations (the VNNI build; "auto" picks it for bf16 models),
    over a float32 model so that only the activations' quantization differs from llm_quant."""
    from engine_core.llm import LLM

    if not native.has_int8(native.load()):
        pytest.skip("int8 activations need an AVX-512 VNNI CPU")
    llm = LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25, quantize_decode=True,
              decode_activations="int8")
    assert llm.engine.model.layers[0].mlp.down_proj.quant.int8
    return llm


def test_decode_activations_setting(model_path):
    from engine_core.platforms.cpu.decode_quant import resolve_activations

    vnni = native.has_int8(native.load())
    assert resolve_activations(None, torch.bfloat16) == ("int8" if vnni else "float32")
    assert resolve_activations("auto", torch.float32) == "float32"
    assert resolve_activations("float32", torch.bfloat16) == "float32"
    with pytest.raises(ValueError, match="decode_activations must be one of auto, float32, int8"):
        resolve_activations("int4", torch.bfloat16)
    if not vnni:
        with pytest.raises(ValueError, match="VNNI"):
            resolve_activations("int8", torch.bfloat16)


@pytest.fixture(scope="module")
def llm_quant_torch(model_path):
    """Decode rows on torch's int4/int8 matmuls: the path without a C compiler."""
    from engine_core.llm import LLM

    with mock.patch.object(native, "load", return_value=None):
        llm = LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25,
                  quantize_decode=True)
    assert isinstance(llm.engine.model.layers[0].mlp.down_proj.quant, Int4Matmul)
    return llm


def test_int4_matmul_uses_the_files_own_weights(model_path):
    gguf = GGUFFile(model_path)
    config = gguf.model_config()
    q4 = dict(gguf.q4_weights(config))
    dense = dict(gguf.weights(config))
    name = "model.layers.3.self_attn.q_proj.weight"  # Q/K rows are unpermuted in both paths
    assert torch.equal(q4[name].dequantize(), dense[name])
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    ref = x @ dense[name].T
    got = Int4Matmul(q4[name])(x).float()
    # bf16 activations and scales: ~3 significant digits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_int8_matmul_and_row_split():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    layer = DecodeQuantLinear(linear, Int8Matmul(linear.weight))
    x = torch.randn(7, 64)
    ref = linear(x)
    assert torch.equal(layer(x), ref)  # no forward context: every row dense, bit for bit
    with use(ForwardContext(num_quant_rows=0)):
        assert torch.equal(layer(x), ref)
    with use(ForwardContext(num_quant_rows=3)):
        out = layer(x)
    assert torch.equal(out[3:], linear(x[3:]))
    assert ((out[:3] - ref[:3]).abs().max() / ref.abs().max()).item() < 2e-2


def test_lm_head_refines_its_best_candidates_in_float32():
    """bf16 logits near 20 are 0.125 apart, so distinct logits tie; the best candidates of a
    decode row are recomputed with the dense weights, the rest keep the quantized value."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 500, bias=True)
    with torch.no_grad():
        linear.weight.mul_(8.0)  # logits of ~±20
    head = DecodeQuantLMHead(linear, Int8Matmul(linear.weight))
    x = torch.randn(6, 32)
    ref = linear(x)
    with use(ForwardContext(num_quant_rows=4)):
        out = head(x)
    assert out.dtype == torch.float32
    assert torch.equal(out[4:], linear(x[4:]))  # prefill rows: dense, bit for bit
    for r in range(4):
        best = ref[r].topk(3).indices  # the true best three are among the refined ones
        assert torch.allclose(out[r, best], ref[r, best], rtol=0, atol=1e-4)
        assert int(out[r].argmax()) == int(ref[r].argmax())
        exact = (out[r] - ref[r]).abs() < 1e-4
        assert REFINE_TOP_K <= int(exact.sum()) < 100  # the others stay approximate


def test_requantize_int4_is_min_max_per_32():
    """The lm_head's 4-bit screen: each weight within half a step of its group's grid, the
    group's extremes kept, a constant group exact; chunking changes nothing."""
    torch.manual_seed(0)
    w = torch.randn(40, 64).to(torch.bfloat16)
    w[3, :32] = 0.25  # a constant group
    q4 = requantize_int4(w, chunk_rows=16)
    assert q4.q.dtype == torch.uint8 and int(q4.q.max()) <= 15
    groups = w.float().view(40, 2, 32)
    assert torch.equal(q4.m, groups.amin(dim=2))
    assert torch.equal(q4.d, (groups.amax(dim=2) - groups.amin(dim=2)) / 15)
    err = (q4.dequantize() - w.float()).view(40, 2, 32).abs().amax(dim=2)
    assert bool((err <= q4.d / 2 * (1 + 1e-5) + 1e-7).all())
    assert torch.equal(q4.dequantize()[3, :32], w.float()[3, :32])
    for f in ("q", "d", "m"):
        assert torch.equal(getattr(requantize_int4(w, chunk_rows=7), f), getattr(q4, f))


def test_lm_head_screens_in_4_bits_with_int8_activations_only(llm_quant, llm_quant_int8):
    """lm_head_screen="auto": float32 activations keep their 1e-3 log-probabilities (the
    screen's logits enter every normalizer), int8 ones read half the head's bytes."""
    from engine_core.platforms.cpu.decode_quant import NativeQ4Matmul, NativeQ8Matmul

    assert isinstance(llm_quant.engine.model.lm_head.quant, NativeQ8Matmul)
    assert isinstance(llm_quant_int8.engine.model.lm_head.quant, NativeQ4Matmul)


@pytest.mark.parametrize("engine",
                         ["llm_quant", "llm_quant_bf16", "llm_quant_int8", "llm_quant_torch"])
def test_quantized_decode_is_batch_invariant(engine, request):
    assert_batched_equals_solo(request.getfixturevalue(engine))


# decode log-probabilities against the dense engine's: the C kernels compute in float32 with
# the file's exact weights; torch's matmuls round activations and scales to bf16; int8
# activations (about 0.5 % error per matmul, over 121 matmuls) moved the top-5 log-probabilities
# of these prompts by up to 0.31, the chosen token's by up to 0.1
DECODE_LOGPROB_TOLERANCE = {"llm_quant": 1e-3, "llm_quant_torch": 0.1, "llm_quant_int8": 0.5}


@pytest.mark.parametrize("engine", ["llm_quant", "llm_quant_torch", "llm_quant_int8"])
def test_quantized_decode_tracks_dense_logprobs(llm_fp32, engine, request):
    llm_quant = request.getfixturevalue(engine)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    dense = llm_fp32.generate(PROMPTS, params)
    quant = llm_quant.generate(PROMPTS, params)
    for d, q in zip(dense, quant, strict=True):
        d, q = d.outputs[0], q.outputs[0]
        # the first token comes from the (dense) prefill in both engines; with the C kernels
        # the RMSNorms run in C, a float32 sum in another order
        assert d.token_ids[0] == q.token_ids[0] and d.logprobs[0].keys() == q.logprobs[0].keys()
        for tok, lp in d.logprobs[0].items():
            assert abs(lp - q.logprobs[0][tok]) < 1e-4
        # the second from a decode step: same top token, log-probabilities close
        assert d.token_ids[1] == q.token_ids[1]
        for tok, lp in d.logprobs[1].items():
            if tok in q.logprobs[1]:
                assert abs(lp - q.logprobs[1][tok]) < DECODE_LOGPROB_TOLERANCE[engine]


def test_decode_layers_in_one_call_match_the_per_operation_path(llm_quant):
    """NativeDecodeLayers (every layer of the decode rows in one C call) against the same C
    kernels called one operation at a time from Python: same tokens, log-probabilities equal
    up to float32 rounding (only silu is computed differently). Not with int8 activations:
    rounding to int8 turns a last-bit difference into a quantization step now and then, and
    the steps compound over the layers, so the two paths differ about as much as either
    differs from the float32 path (test_quantized_decode_tracks_dense_logprobs)."""
    require_native_kernels()  # skips without a compiler or AVX2/FMA; a failed build fails
    runner = llm_quant.engine.runner
    assert runner.quantization.decode_layers is not None, \
        "the C kernels load but decode_layers is not set"
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    fused = llm_quant.generate(PROMPTS, params)
    saved, runner.quantization = runner.quantization, DecodeQuantization(decode_layers=None)
    try:
        per_op = llm_quant.generate(PROMPTS, params)
    finally:
        runner.quantization = saved
    for a, b in zip(fused, per_op, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
