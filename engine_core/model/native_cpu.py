"""The C kernels (kernels/csrc) in the model's CPU forward, for every row of a step.

Attention (rope, K/V store and attention over a float32 or bf16 cache, each row over its own
context) runs in C for decode and prefill rows alike, and with a float32 model so does every
RMSNorm. This is independent of quantized decode matmuls (decode_quant.py): a prefill worker,
which never decodes, must write the same KV as a colocated engine's prefill, or a prompt
handed off to a decode worker continues differently from the same prompt served colocated.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from engine_core.model.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


def supports_native_attention(model: DecoderForCausalLM) -> bool:
    """Whether the C attention kernel takes this model's head size."""
    head_dim = model.config.head_dim
    return head_dim % 8 == 0 and head_dim <= 256


def use_native_kernels(model: DecoderForCausalLM, lib: ctypes.CDLL) -> bool:
    """Route the model's attention (and a float32 model's RMSNorms) through `lib`, in place.
    Returns False, changing nothing, if the kernels do not take this model's shapes (logged).
    Windowed layers pass their window to the kernel."""
    if not supports_native_attention(model):
        logger.info("the C attention kernel does not take head_dim %d: attention runs on the "
                    "torch path", model.config.head_dim)
        return False
    is_float32 = model.embed_tokens.weight.dtype == torch.float32
    for layer in model.layers:
        layer.self_attn.native = lib
        if is_float32 and layer.self_attn.q_norm is not None:  # as pd_decode_layers does
            layer.self_attn.q_norm.native = layer.self_attn.k_norm.native = lib
        if is_float32:  # (OLMo 2's layers have no input norm)
            for norm in (getattr(layer, "input_layernorm", None), layer.post_attention_layernorm):
                if norm is not None:
                    norm.native = lib
    if is_float32:
        model.norm.native = lib
    return True
