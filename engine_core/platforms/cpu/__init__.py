"""The CPU platform: the C kernels (kernels/csrc, loaded by kernels/native.py) where they load,
torch's ops where they do not.

- Attention: rope, K/V store and attention of every row in C, each row over its own context
  (ModelOps.row_attention), and with a float32 model the RMSNorms too. A prefill worker, which
  never decodes, writes the same KV as a colocated engine's prefill, so a prompt handed off
  continues as it would have colocated.
- Decode rows: the 4/8-bit matmuls of a GGUF's blocks (and with --quantization int8 of
  requantized floats), and where every layer is in C, all of a step's decode rows through
  every layer in one call (decode_quant.py); the runner's forward splits the step for it.
- Prefill rows: torch's dense matmuls, in calls of one shape (bf16 projections whose rows
  would vary) or under MKL's strict reproducibility (float32), so a row's result does not
  depend on the rows beside it (prefill_matmuls.py).
- Sampling: the C kernels' one-pass sampler and top-k (engine_core/sampler.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from engine_core import openmp_env
from engine_core.model.forward_context import ForwardContext, use
from engine_core.model.ops import ModelOps
from engine_core.platforms import Platform
from engine_core.platforms.cpu.prefill_matmuls import block_prefill_rows, float32_rows_vary
from engine_core.platforms.cpu.prefill_mlp import slab_mlps
from kernels import native

logger = logging.getLogger(__name__)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16 or AMX).

    Without it torch emulates bf16 matmuls: measured on a 2-core AVX2 EPYC, 0.2 GFLOP/s against
    68 GFLOP/s in fp32, so bf16 there would be a 300x slowdown, not a speedup.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_default_dtype() -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively, else float32."""
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def supports_row_attention(head_dim: int) -> bool:
    """Whether the C attention kernel takes this head size."""
    return head_dim % 8 == 0 and head_dim <= 256


@functools.cache
def _warn_if_spin_set_too_late() -> None:
    """Once per process: torch came before engine_core, so libgomp's idle threads spin for its
    default 300,000 iterations after every parallel region (engine_core/openmp_env.py)."""
    if openmp_env.SPIN_SET_TOO_LATE:
        logger.warning(
            "torch was imported before engine_core, so OpenMP's idle threads spin for "
            "libgomp's default 300,000 iterations after each parallel region (about a fifth "
            "more CPU per token on a small model); import engine_core (or pdserve) first, or "
            "set GOMP_SPINCOUNT=3000 in the environment")


@functools.cache
def _warn_if_float32_rows_vary() -> None:
    """Once per process: MKL multiplied before engine_core set MKL_CBWR (openmp_env.py), so
    float32 prefill rows depend on the rows beside them."""
    if float32_rows_vary():
        logger.warning(
            "torch's float32 matmuls give a row a different result beside other rows than "
            "alone (MKL ran before engine_core set MKL_CBWR=AUTO,STRICT): float32 prompts' "
            "KV depends on what is prefilled beside them; import engine_core (or pdserve) "
            "before any torch matmul, or set MKL_CBWR=AUTO,STRICT in the environment")


class NativeSampling:
    """The C kernels' sampling (kernels/csrc/sample.c), for engine_core/sampler.py: one pass
    per row selects the candidates of top-k/top-p/min-p and draws; a one-pass top-1 where
    torch's argmax over [32, 49152] float32 logits took ten times as long."""

    def __init__(self, lib) -> None:
        self.lib = lib

    def sample(self, logits, temperature, top_k, top_p, min_p, u) -> torch.Tensor:
        return native.sample(self.lib, logits, temperature, top_k, top_p, min_p, u)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[1] < native.TOPK_MAX:
            return logits.argmax(dim=-1)
        return native.topk(self.lib, logits.contiguous(), 1)[:, 0]


class CpuPlatform(Platform):
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        _warn_if_spin_set_too_late()
        _warn_if_float32_rows_vary()
        # the C kernels sample, whichever attention runs
        lib = native.load()
        self.sampling = NativeSampling(lib) if lib is not None else None

    def default_dtype(self) -> torch.dtype:
        return cpu_default_dtype()

    def model_ops(self, config, dtype: torch.dtype) -> ModelOps:
        ops = super().model_ops(config, dtype)
        lib = self.kernels.lib
        if lib is None:
            return ops
        if not supports_row_attention(config.head_dim):
            logger.info("the C attention kernel does not take head_dim %d: attention runs on "
                        "the torch path", config.head_dim)
            return ops
        # bf16: the reference's roundings, one pass (torch's path takes seven over the rows)
        norm = (functools.partial(native.add_rms_norm, lib)
                if dtype in (torch.float32, torch.bfloat16) else None)
        return dataclasses.replace(ops, row_attention=functools.partial(native.row_attention,
                                                                        lib), rms_norm=norm)

    def quantize_decode(self, requested: bool | None) -> bool:
        return True if requested is None else requested

    def decode_blocks(self, model, config, gguf, source, dtype, requantize: bool,
                      prefill_weights: str):
        from engine_core.platforms.cpu.weights import decode_blocks

        return decode_blocks(model, config, gguf, source, dtype, requantize, prefill_weights)

    def quantize_for_decode(self, model, blocks, activations: str, requantize: bool):
        from engine_core.platforms.cpu.decode_quant import quantize_for_decode

        return quantize_for_decode(model, blocks.q4, activations, blocks.q8,
                                   requantize_floats=requantize,
                                   head_in_blocks=blocks.head_in_blocks)

    def invariant_rows(self, model) -> None:
        turned = block_prefill_rows(model)
        slab_mlps(model)
        if turned:
            logger.debug("%d projections multiply prefill rows in calls of one size each",
                         turned)

    def resolve_activations(self, setting: str | None, dtype: torch.dtype) -> str:
        from engine_core.platforms.cpu.decode_quant import resolve_activations

        return resolve_activations(setting, dtype)

    def check_quantization(self, setting: str | None) -> str | None:
        """--quantization: None (or "none") computes the weights as loaded; "int8" (a
        LoadConfig checks the name) requantizes float weights to int8 per 32 for the decode
        rows (decode_quant.py)."""
        return None if setting in (None, "none") else setting

    def forward(self, model, input_ids, positions, kv_cache, meta, ctx: ForwardContext,
                num_layers=None, quantization=None) -> torch.Tensor:
        """With the C layers (quantization.decode_layers), the decode rows go through every
        layer in one call, float32, and the prefill rows beside them through the model,
        dense; a forward whose layers are watched (ctx.on_layer_done) runs layer by layer."""
        layers = None if quantization is None else quantization.decode_layers
        nd = meta.num_decode_tokens
        if (layers is None or nd == 0 or ctx.on_layer_done is not None
                or not kv_cache.is_contiguous()):
            return super().forward(model, input_ids, positions, kv_cache, meta, ctx, num_layers)
        cos_sin = model.cos_sin[positions[:nd]]
        decoded = layers(model.embed(input_ids[:nd]), cos_sin, kv_cache, meta,
                         len(model.layers) if num_layers is None else num_layers,
                         model.other_rope(positions[:nd], cos_sin))
        if nd == input_ids.shape[0]:
            return decoded
        with use(dataclasses.replace(ctx, num_quant_rows=0)):  # prefill rows: all dense
            prefilled = model(input_ids[nd:], positions[nd:], kv_cache,
                              dataclasses.replace(meta, decodes_done=True), num_layers)
        return torch.cat([decoded, prefilled.float()])

    def decode_threads(self, quantized: bool) -> int:
        # decode-only steps over the C kernels, whose results do not depend on the count
        return torch.get_num_threads() if quantized else 1
