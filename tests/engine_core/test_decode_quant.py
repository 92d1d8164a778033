"""Decode rows on weight-only 4/8-bit matmuls (engine_core/model/decode_quant.py), real model."""

from __future__ import annotations

import pytest
import torch
from test_real_model import PROMPTS, assert_batched_equals_solo  # same folder (rootdir import)

from engine_core.model.decode_quant import DecodeQuantLinear, DecodeRows, Int4Matmul, Int8Matmul
from engine_core.sampling_params import SamplingParams
from engine_core.weights.gguf_loader import GGUFFile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm_quant(model_path):
    from engine_core.llm import LLM

    return LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25, quantize_decode=True)


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
    rows = DecodeRows()
    layer = DecodeQuantLinear(linear, Int8Matmul(linear.weight), rows)
    x = torch.randn(7, 64)
    ref = linear(x)
    rows.n = 0
    assert torch.equal(layer(x), ref)  # no decode rows: the dense path, bit for bit
    rows.n = 3
    out = layer(x)
    assert torch.equal(out[3:], linear(x[3:]))
    assert ((out[:3] - ref[:3]).abs().max() / ref.abs().max()).item() < 2e-2


def test_quantized_decode_is_batch_invariant(llm_quant):
    assert_batched_equals_solo(llm_quant)


def test_quantized_decode_tracks_dense_logprobs(llm_fp32, llm_quant):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    dense = llm_fp32.generate(PROMPTS, params)
    quant = llm_quant.generate(PROMPTS, params)
    for d, q in zip(dense, quant, strict=True):
        d, q = d.outputs[0], q.outputs[0]
        # the first token comes from the (dense) prefill in both engines
        assert d.token_ids[0] == q.token_ids[0] and d.logprobs[0] == q.logprobs[0]
        # the second from a decode step: same top token, log-probabilities within 0.1 nats
        assert d.token_ids[1] == q.token_ids[1]
        tok = d.token_ids[1]
        assert abs(d.logprobs[1][tok] - q.logprobs[1][tok]) < 0.1
