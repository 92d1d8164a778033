"""Prefill from a GGUF's own 4/8-bit blocks (load_model's prefill_weights="quantized"): the
projections keep no dense copy, every row multiplies the blocks, and the weights take about
the file's size, as in llama.cpp. The blocks hold exactly the values the dense copy would
(the dequantized file), so with float32 activations the two ways agree to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from engine_core.platforms.cpu.decode_quant import DecodeQuantLinear
from engine_core.platforms.cpu.projections import projections
from engine_core.platforms.cpu.weights import resolve_prefill_weights
from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import CASES

transformers = pytest.importorskip("transformers")


def _param_bytes(eng) -> int:
    """Bytes of the model's materialized parameters (the dense copies; tied ones once)."""
    seen = {p.data_ptr(): p.nbytes for p in eng.model.parameters() if not p.is_meta}
    return sum(seen.values())


@pytest.mark.parametrize(("case", "arch", "qtype"), [
    ("llama", "llama", GGMLQuantizationType.Q4_0),
    ("qwen2", "qwen2", GGMLQuantizationType.Q8_0),  # q/k/v biases beside the blocks
    ("qwen3-moe", "qwen3moe", GGMLQuantizationType.Q4_1)])
def test_prefill_from_the_files_blocks(case, arch, qtype, tmp_path):
    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    held = tm.write_gguf(hf, tmp_path / "m.gguf", arch=arch, permute=arch == "llama",
                         qtype=qtype)
    tm.use_held_weights(hf, held)  # the reference holds what the file holds
    dense = tm.engine(tmp_path / "m.gguf", quantize_decode=True, decode_activations="float32",
                      prefill_weights="dense", max_num_batched_tokens=16)
    blocks = tm.engine(tmp_path / "m.gguf", quantize_decode=True, decode_activations="float32",
                       prefill_weights="quantized", max_num_batched_tokens=16)
    linears = [getattr(m, a) for m, a in projections(blocks.model)]
    assert linears and all(isinstance(q, DecodeQuantLinear) and q.quant_only
                           and q.weight.is_meta for q in linears)
    assert not any(getattr(m, a).quant_only for m, a in projections(dense.model))
    # what is left dense: the embedding, norms, biases, a router
    assert _param_bytes(blocks) < 0.5 * _param_bytes(dense)
    prompts = tm.prompts(tm.SIZES["vocab_size"], [9, 40])
    for p in prompts:
        ours = tm.prompt_logits(blocks, p)
        assert tm.relative_error(ours, tm.prompt_logits(dense, p)) < 1e-5
        assert tm.relative_error(ours, tm.hf_logits(hf, p)) < 1e-3
    # chunked prefill (16-token budget) beside decode rows, and a prefix-cache hit
    got = tm.greedy(blocks, prompts + [prompts[1][:32] + prompts[0]], 12)
    assert got == tm.greedy(dense, prompts + [prompts[1][:32] + prompts[0]], 12)
    assert got[1][:2] == tm.hf_greedy(hf, prompts[1], 2)


def test_prefill_from_blocks_on_the_user_defaults(tmp_path):
    """bf16 with the CPU's own choice of decode activations (int8 on a VNNI CPU: then the
    prefill rows' matmuls quantize their activations per 32 too, as llama.cpp's do)."""
    config_cls, overrides = CASES["llama"]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    held = tm.write_gguf(hf, tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q4_0)
    tm.use_held_weights(hf, held)
    eng = tm.engine(tmp_path / "m.gguf", dtype="bfloat16", quantize_decode=None,
                    prefill_weights="quantized")
    assert eng.dtype == torch.bfloat16
    assert all(getattr(m, a).quant_only for m, a in projections(eng.model))
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    theirs = tm.hf_logits(hf.to(torch.bfloat16), prompt).float()
    assert tm.relative_error(tm.prompt_logits(eng, prompt), theirs) < 0.05
    got = tm.greedy(eng, [prompt], 8)[0]
    assert len(got) == 8 and got[0] == int(theirs[-1].argmax())


def test_quantized_prefill_needs_a_files_blocks(tmp_path):
    config_cls, overrides = CASES["llama"]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    with pytest.raises(ValueError, match="needs a GGUF model or a checkpoint with MXFP4 experts"):
        tm.engine(tmp_path / "hf", quantize_decode=True, prefill_weights="quantized")
    tm.write_gguf(hf, tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="needs a GGUF model or a checkpoint with MXFP4 experts"):
        tm.engine(tmp_path / "m.gguf", quantize_decode=False, prefill_weights="quantized")
    with pytest.raises(ValueError, match="prefill_weights must be one of auto, dense, "):
        tm.engine(tmp_path / "m.gguf", quantize_decode=True, prefill_weights="blocks")
    # auto keeps the dense copy of a model this small
    eng = tm.engine(tmp_path / "m.gguf", quantize_decode=True)
    assert not any(getattr(m, a).quant_only for m, a in projections(eng.model))


def test_auto_chooses_by_the_memory_available():
    from engine_core.platforms.cpu.weights import available_memory_bytes

    available = available_memory_bytes()
    assert available is not None and available > 0  # Linux: /proc/meminfo
    assert resolve_prefill_weights("auto", 1 << 20, 1 << 20) == "dense"
    assert resolve_prefill_weights("auto", available, 1 << 20) == "quantized"
    # pdserve up's workers each load a copy
    half = int(0.3 * available)
    assert resolve_prefill_weights("auto", half, 0, num_copies=1) == "dense"
    assert resolve_prefill_weights("auto", half, 0, num_copies=3) == "quantized"
    assert resolve_prefill_weights("dense", available, available) == "dense"
    assert resolve_prefill_weights("quantized", 1, 1) == "quantized"
