"""Weights are computed as loaded unless --quantization asks otherwise: float weights stay float
for every row on the CPU's defaults, a GGUF's blocks are multiplied as stored, and
quantization="int8" requantizes float weights for the decode rows (vLLM's --quantization)."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from engine_core.engine_config import LoadConfig
from engine_core.platforms import select_platform
from engine_core.platforms.cpu.decode_quant import DecodeQuantLinear, NativeFloatMatmul
from engine_core.platforms.cuda import CudaPlatform
from kernels import native
from tests.engine_core import tiny_models as tm


def quantized_linears(eng) -> int:  # a float weight multiplied as loaded is not quantized
    return sum(isinstance(m, DecodeQuantLinear) and not isinstance(m.quant, NativeFloatMatmul)
               for m in eng.model.modules())


def test_float_weights_stay_float_on_the_defaults(tmp_path):
    """Nothing is quantized: with the C kernels the decode rows multiply each float weight in
    place (NativeFloatMatmul), through every layer in one C call; without them, torch does."""
    tm.build_hf(transformers.LlamaConfig, tmp_path)
    eng = tm.engine(tmp_path, quantize_decode=None)  # the engine's own defaults
    assert eng.decode_activations is None and eng.quantization is None
    linears = [m for m in eng.model.modules() if isinstance(m, DecodeQuantLinear)]
    if native.load() is None:
        assert eng.runner.quantization is None and not linears
        return
    assert not eng.runner.quantization.quantized
    assert eng.runner.quantization.decode_layers is not None
    assert len(linears) == 4 * len(eng.model.layers)  # qkv, o, gate_up, down: none requantized
    for linear in linears:
        assert isinstance(linear.quant, NativeFloatMatmul)
        assert linear.quant.qs.data_ptr() == linear.dense.weight.data_ptr()


def test_int8_requantizes_float_weights_for_decode(tmp_path):
    tm.build_hf(transformers.LlamaConfig, tmp_path)
    eng = tm.engine(tmp_path, quantize_decode=None, quantization="int8")
    assert eng.runner.quantization is not None and eng.decode_activations is not None
    layers = len(eng.model.layers)
    assert quantized_linears(eng) == 4 * layers  # qkv, o, gate_up and down of every layer
    assert eng.quantization == "int8"


@pytest.mark.parametrize("qtype, blocks", [(Q.F16, False), (Q.Q4_1, True), (Q.Q8_0, True)])
def test_a_gguf_is_computed_as_stored(tmp_path, qtype, blocks):
    """A float GGUF decodes on its floats; a block-quantized one on its blocks, defaults."""
    hf = tm.build_hf(transformers.LlamaConfig, tmp_path / "hf")
    tm.write_gguf(hf, tmp_path / "m.gguf", qtype=qtype)
    eng = tm.engine(tmp_path / "m.gguf", quantize_decode=None)
    quantization = eng.runner.quantization
    assert (quantization is not None and quantization.quantized) == blocks
    assert (quantized_linears(eng) > 0) == blocks


def test_bad_settings_are_refused_by_name():
    cpu = select_platform("cpu")
    assert cpu.check_quantization("none") is None
    assert cpu.check_quantization("int8") == "int8"
    with pytest.raises(ValueError, match="quantization must be none or one of int8, got 'fp8'"):
        LoadConfig(quantization="fp8")
    # a CUDA platform's check, without a GPU here (its kernels are not built for it)
    cuda = object.__new__(CudaPlatform)
    cuda.device = torch.device("cuda", 0)
    assert cuda.check_quantization(None) is None
    with pytest.raises(ValueError, match="on cuda:0 leave it unset"):
        cuda.check_quantization("int8")
