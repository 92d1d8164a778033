"""Build the model on the meta device, materialize it, then load real weights into it."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine_core.config import ModelConfig
from engine_core.model.decode_quant import DecodeQuantization, projections, quantize_for_decode
from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model.feed_forward import stack_experts
from engine_core.model.native_cpu import use_native_kernels
from engine_core.model_files import ModelSource
from engine_core.weights.gguf_loader import GGUFFile
from engine_core.weights.gguf_q4 import Q4_TYPES
from engine_core.weights.gguf_q8 import Q8_TYPES
from engine_core.weights.hf_mxfp4 import mxfp4_experts
from engine_core.weights.safetensors_loader import iter_safetensors, load_hf_config
from kernels import native
from kernels.backends import attention_backend

logger = logging.getLogger(__name__)


PREFILL_WEIGHTS = ("auto", "dense", "quantized")


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantize_decode: bool = False,
    decode_activations: str = "float32", prefill_weights: str = "dense", requantize: bool = False,
) -> tuple[DecoderForCausalLM, ModelConfig, DecodeQuantization | None]:
    """The model with real weights. On CPU, attention runs in the C kernels where they load
    (native_cpu.py). With quantize_decode (CPU only), decode rows of every
    matmul use 4/8-bit weights (see decode_quant.py), with "float32" or "int8" activations
    (decode_activations, as decode_quant.resolve_activations gives it); the
    DecodeQuantization is returned for the runner's ForwardContext. Float weights are
    requantized to int8 for decode only with `requantize` (--quantization int8); without it a
    model with nothing in blocks gets no quantized decode at all (None returned).

    prefill_weights: what the other rows' matmuls read. "dense": a float copy in `dtype`
    beside the 4/8-bit one (fast prefill, about twice the memory of a 4-bit file's weights
    and more). "quantized" (a GGUF, or a checkpoint's MXFP4 experts, with quantize_decode and
    the C kernels): a projection whose parts the file holds in blocks the C kernels read has
    no dense copy; every row multiplies its blocks, as llama.cpp does, so the weights take
    about the file's size. "auto":
    quantized when the dense copies would not fit (resolve_prefill_weights)."""
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
        model = DecoderForCausalLM(config)
    q4 = q8 = None
    if quantize_decode:
        if device.type != "cpu":
            raise ValueError(f"quantize_decode is a CPU path, device is {device}")
        if gguf is not None:  # every supported type's blocks (gguf_q4.py, gguf_q8.py)
            q4, q8 = gguf.block_weights(config)  # unpacked as quantize_for_decode asks
        else:  # a checkpoint's MXFP4 experts (GPT-OSS's), its own 4-bit values
            experts = mxfp4_experts(source.path)
            if experts is not None:
                q4, q8 = {}, experts
        if not (requantize or q4 or q8):
            quantize_decode = False  # nothing held in blocks: the floats are computed as loaded
            q4 = q8 = None
    blocks_only = _blocks_only(model, q4, q8, prefill_weights, source, dtype)
    model = model.to_empty(device=device)
    for module, attr in blocks_only:  # never loaded: the quantized matmul holds the weight
        linear = getattr(module, attr)
        linear.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"),
                                     requires_grad=False)
    model = model.to(dtype)
    model.tie_weights()  # to_empty gives each module its own tensor; share them again
    absent = {p for parts in blocks_only.values() for p in parts}
    model.load_weights(gguf.weights(config, skip=absent, blocks=q8) if gguf is not None
                       else iter_safetensors(source.path), absent=absent)
    model.init_rope(device)
    model.eval().requires_grad_(False)
    backend = attention_backend(device)
    lib = native.load() if backend == "native" else None
    if lib is not None:
        use_native_kernels(model, lib)
    if backend == "triton":  # routed experts as grouped matmuls (kernels/fused_moe.py)
        stack_experts(model)
    quantization = None
    if quantize_decode:
        quantization = quantize_for_decode(model, q4, decode_activations, q8,
                                           requantize_floats=requantize,
                                           head_in_blocks=_head_in_blocks(gguf, config))
    logger.info("loaded %s (%s, %s) in %.1f s", config.name, source.kind, dtype,
                time.perf_counter() - t0)
    return model, config, quantization


def _head_in_blocks(gguf: GGUFFile | None, config: ModelConfig) -> bool:
    """Whether the lm_head (or the embedding it is tied to) is a GGUF's block-quantized
    tensor, which the decode rows then screen with (quantize_for_decode)."""
    if gguf is None:
        return False
    types = gguf.tensor_types()
    name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head = types.get(name, types.get("model.embed_tokens.weight"))
    return head is not None and (head in Q4_TYPES or head in Q8_TYPES)


def _blocks_only(model: DecoderForCausalLM, q4: Mapping | None, q8: Mapping | None,
                 prefill_weights: str, source: ModelSource,
                 dtype: torch.dtype) -> dict[tuple[nn.Module, str], list[str]]:
    """The projections (module, attribute) -> parts that get no dense copy: with
    prefill_weights "quantized" (or "auto" choosing it), those whose every part the model holds
    in 4/8-bit blocks the C kernels multiply (a GGUF's; a checkpoint's MXFP4 experts)."""
    if prefill_weights == "dense":
        return {}
    lib = native.load()
    if q4 is None or q8 is None or lib is None:
        if prefill_weights == "quantized":
            raise ValueError("prefill_weights='quantized' reads 4/8-bit blocks with the C "
                             "kernels: it needs a GGUF model or a checkpoint with MXFP4 "
                             "experts, quantized decode on the CPU and the native kernels (a "
                             "C compiler, AVX2)")
        return {}
    dense_bytes = dense_copy_bytes(source, dtype)
    if resolve_prefill_weights(prefill_weights, dense_bytes, weights_bytes(source)) == "dense":
        return {}
    groups = {key: parts for key, parts in projections(model, q4.keys() | q8.keys()).items()
              if all(p in q4 or p in q8 for p in parts)}
    logger.info("prefill rows multiply the 4/8-bit blocks too: %d projections keep no "
                "dense copy (about %.2f GB of %s not held)", len(groups), dense_bytes / 1e9,
                str(dtype).removeprefix("torch."))
    return groups


def resolve_prefill_weights(setting: str, dense_bytes: int, file_bytes: int,
                            num_copies: int = 1) -> str:
    """"dense" or "quantized" for `setting`; "auto" is quantized where `num_copies` processes'
    dense copies (`dense_bytes` each) and their files' weights would take more than 80 % of
    the memory available now (MemAvailable in /proc/meminfo), else dense."""
    if setting != "auto":
        return setting
    need = num_copies * (dense_bytes + file_bytes)
    available = available_memory_bytes()
    choice = "quantized" if available is not None and need > 0.8 * available else "dense"
    logger.info("prefill weights: %s (auto: %d process(es) x %.2f GB of dense copies and "
                "file, %s GB available)", choice, num_copies, (dense_bytes + file_bytes) / 1e9,
                "unknown" if available is None else f"{available / 1e9:.2f}")
    return choice


def settle_prefill_weights(setting: str, source: ModelSource, dtype: torch.dtype,
                           num_copies: int = 1) -> str:
    """`setting` with "auto" settled before any weight loads, for `num_copies` processes that
    each hold the model (pdserve up's workers; a prefill worker, which quantizes nothing
    unless its prefill reads the blocks). On CUDA there are no blocks to read: auto stays."""
    if setting != "auto" or torch.cuda.is_available():
        return setting
    dense_bytes = dense_copy_bytes(source, dtype)
    if dense_bytes == 0:  # nothing held in blocks a prefill could multiply instead
        return "dense"
    return resolve_prefill_weights("auto", dense_bytes, weights_bytes(source), num_copies)


def weights_bytes(source: ModelSource) -> int:
    """The model's files' bytes: the GGUF, or the folder's safetensors shards."""
    if source.kind == "gguf":
        return source.path.stat().st_size
    return sum(f.stat().st_size for f in source.path.glob("*.safetensors"))


def dense_copy_bytes(source: ModelSource, dtype: torch.dtype) -> int:
    """About the bytes of the dense copies prefill_weights="quantized" would leave out: the
    GGUF's 4/8-bit matrices but its embedding, output head and routers, or a checkpoint's
    MXFP4 experts, in `dtype`; 0 for a safetensors model without them (its weights are dense
    already)."""
    if source.kind != "gguf":
        experts = mxfp4_experts(source.path)
        return 0 if experts is None else experts.num_weights * dtype.itemsize
    reader = GGUFFile(source.path).reader
    return sum(int(t.n_elements) for t in reader.tensors
               if GGMLQuantizationType(t.tensor_type) in (*Q4_TYPES, *Q8_TYPES)
               and t.name not in ("token_embd.weight", "output.weight")
               and ".ffn_gate_inp." not in t.name) * dtype.itemsize


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
