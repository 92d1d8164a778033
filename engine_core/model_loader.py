"""Build the model on the meta device, materialize it, then load real weights into it."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine_core.config import ModelConfig
from engine_core.engine_config import PREFILL_WEIGHTS, QUANTIZED_PREFILL_NEEDS
from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model.feed_forward import stack_experts
from engine_core.model_files import ModelSource
from engine_core.platforms import Platform
from engine_core.platforms.cpu.decode_quant import DecodeQuantization
from engine_core.weights.gguf_loader import GGUFFile
from engine_core.weights.safetensors_loader import iter_safetensors, load_hf_config

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource, dtype: torch.dtype, platform: Platform, quantize_decode: bool = False,
    decode_activations: str = "float32", prefill_weights: str = "dense", requantize: bool = False,
) -> tuple[DecoderForCausalLM, ModelConfig, DecodeQuantization | None]:
    """The model with real weights, built with the kernels `platform` gives it (its
    ModelOps: on the CPU, attention in the C kernels where they load). With quantize_decode
    (the CPU platform only), decode rows of every matmul use 4/8-bit weights (see
    platforms/cpu/decode_quant.py), with "float32" or "int8" activations (decode_activations,
    as decode_quant.resolve_activations gives it); the DecodeQuantization is returned for the
    runner's forward. Float weights are requantized to int8 for decode only with `requantize`
    (--quantization int8); without it they are multiplied as loaded, by the C kernels where
    they load (so the decode rows still take the one-call C layers), else by torch (None
    returned).

    prefill_weights: what the other rows' matmuls read. "dense": a float copy in `dtype`
    beside the 4/8-bit one (fast prefill, about twice the memory of a 4-bit file's weights
    and more). "quantized" (a GGUF, or a checkpoint's MXFP4 experts, with quantize_decode and
    the C kernels): a projection whose parts the file holds in blocks the C kernels read has
    no dense copy; every row multiplies its blocks, as llama.cpp does, so the weights take
    about the file's size. "auto": quantized when the dense copies would not fit
    (platforms/cpu/weights.resolve_prefill_weights)."""
    t0 = time.perf_counter()
    if prefill_weights not in PREFILL_WEIGHTS:
        raise ValueError(f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS)}, got "
                         f"{prefill_weights!r}")
    gguf = None
    if source.kind == "gguf":
        gguf = GGUFFile(source.path)
        config = gguf.model_config()
    else:
        config = load_hf_config(source.path)
    with torch.device("meta"):
        model = DecoderForCausalLM(config, platform.model_ops(config, dtype))
    blocks = (platform.decode_blocks(model, config, gguf, source, dtype, requantize,
                                     prefill_weights) if quantize_decode else None)
    if blocks is None and prefill_weights == "quantized":  # no blocks to multiply instead
        raise ValueError(QUANTIZED_PREFILL_NEEDS)
    blocks_only = blocks.blocks_only if blocks is not None else {}
    model = model.to_empty(device=platform.device)
    for module, attr in blocks_only:  # never loaded: the quantized matmul holds the weight
        linear = getattr(module, attr)
        linear.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"),
                                     requires_grad=False)
    model = model.to(dtype)
    model.tie_weights()  # to_empty gives each module its own tensor; share them again
    absent = {p for parts in blocks_only.values() for p in parts}
    model.load_weights(gguf.weights(config, skip=absent, blocks=blocks.q8 if blocks else None)
                       if gguf is not None else iter_safetensors(source.path), absent=absent)
    model.init_rope(platform.device)
    model.eval().requires_grad_(False)
    stack_experts(model)  # where the platform's experts are grouped matmuls (Triton)
    quantization = None
    if blocks is not None:
        quantization = platform.quantize_for_decode(model, blocks, decode_activations,
                                                    requantize)
    platform.invariant_rows(model)
    logger.info("loaded %s (%s, %s) in %.1f s", config.name, source.kind, dtype,
                time.perf_counter() - t0)
    return model, config, quantization
