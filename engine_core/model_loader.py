"""Build the model on the meta device, materialize it, then load real weights into it."""

from __future__ import annotations

import logging
import time

import torch

from engine_core.config import ModelConfig
from engine_core.model.decode_quant import DecodeQuantization, quantize_for_decode
from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model.native_cpu import use_native_kernels
from engine_core.model_files import ModelSource
from engine_core.weights.gguf_loader import NATIVE_DECODE_TYPES, GGUFFile
from engine_core.weights.safetensors_loader import iter_safetensors, load_hf_config
from kernels import native
from kernels.backends import attention_backend

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantize_decode: bool = False,
    decode_activations: str = "float32",
) -> tuple[DecoderForCausalLM, ModelConfig, DecodeQuantization | None]:
    """The model with real weights. On CPU, attention runs in the C kernels where they load
    (native_cpu.py). With quantize_decode (CPU only), decode rows of every
    matmul use 4/8-bit weights (see decode_quant.py), with "float32" or "int8" activations
    (decode_activations, as decode_quant.resolve_activations gives it); the
    DecodeQuantization is returned for the runner's ForwardContext."""
    t0 = time.perf_counter()
    gguf = None
    if source.kind == "gguf":
        gguf = GGUFFile(source.path)
        config = gguf.model_config()
        weights = gguf.weights(config)
    else:
        config = load_hf_config(source.path)
        weights = iter_safetensors(source.path)
    with torch.device("meta"):
        model = DecoderForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty gives each module its own tensor; share them again
    model.load_weights(weights)
    model.init_rope(device)
    model.eval().requires_grad_(False)
    lib = native.load() if attention_backend(device) == "native" else None
    if lib is not None:
        use_native_kernels(model, lib)
    quantization = None
    if quantize_decode:
        if device.type != "cpu":
            raise ValueError(f"quantize_decode is a CPU path, device is {device}")
        dense = set()
        if gguf is not None:
            types = gguf.tensor_types()
            dense = {n for n, t in types.items() if t not in NATIVE_DECODE_TYPES}
            if dense:
                logger.info(
                    "GGUF tensor types %s have no C decode kernel: %d tensors decode on the "
                    "torch path (dense float weights)",
                    ", ".join(sorted({types[n].name for n in dense})), len(dense))
        quantization = quantize_for_decode(
            model, dict(gguf.q4_weights(config)) if gguf else None, decode_activations, dense,
            dict(gguf.q8_weights(config)) if gguf else None)
    logger.info("loaded %s (%s, %s) in %.1f s", config.name, source.kind, dtype,
                time.perf_counter() - t0)
    return model, config, quantization
