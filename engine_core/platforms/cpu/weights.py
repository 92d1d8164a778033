"""What the CPU platform loads besides the dense weights: a model's 4/8-bit blocks for the
decode rows' matmuls (a GGUF's; a checkpoint's MXFP4 experts), and whether prefill rows keep a
dense float copy of them or multiply the blocks too (prefill_weights)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine_core.config import ModelConfig
from engine_core.engine_config import QUANTIZED_PREFILL_NEEDS
from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model_files import ModelSource
from engine_core.platforms.cpu.projections import projections
from engine_core.weights.gguf_loader import GGUFFile
from engine_core.weights.gguf_q4 import Q4_TYPES
from engine_core.weights.gguf_q8 import Q8_TYPES
from engine_core.weights.hf_mxfp4 import mxfp4_experts
from kernels import native

logger = logging.getLogger(__name__)

@dataclass
class DecodeBlocks:
    """The blocks a model's decode rows multiply: Hugging Face-named 4-bit (q4) and q8-family
    (q8) weights, and the projections (module, attribute) -> parts left without a dense copy
    (prefill_weights "quantized"). head_in_blocks: the lm_head (or the embedding it is tied
    to) is a GGUF's block-quantized tensor, which the decode rows then screen with."""

    q4: dict = field(default_factory=dict)
    q8: dict = field(default_factory=dict)
    blocks_only: dict = field(default_factory=dict)
    head_in_blocks: bool = False


def decode_blocks(model: DecoderForCausalLM, config: ModelConfig, gguf: GGUFFile | None,
                  source: ModelSource, dtype: torch.dtype, requantize: bool,
                  prefill_weights: str) -> DecodeBlocks | None:
    """The model's blocks for quantized decode rows, or None where there is nothing to use
    them for: float weights without --quantization int8 and without the C kernels (torch
    computes them as loaded). With the kernels, such a model gets no blocks but its decode
    rows still go through them, its float weights as loaded (NativeFloatMatmul)."""
    q4 = q8 = None
    if gguf is not None:  # every supported type's blocks (gguf_q4.py, gguf_q8.py)
        q4, q8 = gguf.block_weights(config)  # unpacked as quantize_for_decode asks
    else:  # a checkpoint's MXFP4 experts (GPT-OSS's), its own 4-bit values
        experts = mxfp4_experts(source.path)
        if experts is not None:
            q4, q8 = {}, experts
    if not (requantize or q4 or q8 or native.load() is not None):
        return None
    return DecodeBlocks({} if q4 is None else q4, {} if q8 is None else q8,
                        _blocks_only(model, q4, q8, prefill_weights, source, dtype),
                        _head_in_blocks(gguf, config))


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
            raise ValueError(QUANTIZED_PREFILL_NEEDS)
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
