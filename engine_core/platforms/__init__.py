"""The platform an engine runs on, chosen once at its construction: every decision that depends
on the device or on which kernels loaded is made here, and nowhere else in engine_core.

    engine  --select_platform(device)-->  CpuPlatform | CudaPlatform
              |  .kernels        the attention backend (kernels/backends.py), logged once
              |  .model_ops()    the kernels the model's modules call (model/ops.py)
              |  .prepare()      what a built model gets from outside: the CPU's quantized
              |                  decode rows (cpu/decode_quant.py) and batch-invariant
              |                  prefill rows (cpu/prefill_matmuls.py), Triton's grouped experts
              |  .forward()      the model runner's forward: on the CPU, a step's decode rows
              |                  through every layer in one C call where that applies
              |  dtype, quantization, pinned uploads, CUDA graphs, async scheduling, threads

The model (engine_core/model/) stays plain PyTorch over the ModelOps it is given, and imports
no kernel (an import-linter contract). As vLLM's platform classes and mini-sglang's attention
backends behind one base class.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine_core.model.forward_context import ForwardContext, use
from engine_core.model.ops import ModelOps
from kernels.backends import AttentionKernels, attention_kernels, select_backend

if TYPE_CHECKING:
    from engine_core.config import ModelConfig
    from engine_core.model.attention import AttentionMetadata
    from engine_core.model.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


class Platform:
    """What differs between devices, behind one small interface (the subclasses fill it)."""

    name = "?"
    pin_memory = False  # host staging buffers pinned, copies asynchronous
    cuda_graphs = False  # decode steps may be captured as CUDA graphs (decode_graphs.py)
    async_scheduling = False  # the default: prepare a step while the last one runs
    sampling = None  # the sampling kernels of engine_core/sampler.py (None: torch's ops)
    kv_in_host_memory = True  # the KV pool is host RAM (no host RAM offload tier below it)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        backend = select_backend(device)
        self.kernels: AttentionKernels = attention_kernels(backend)
        if (str(device), backend) not in _logged:  # once per process, not per engine
            _logged.add((str(device), backend))
            logger.info("platform %s on %s: attention on the %s kernels", self.name, device,
                        backend)

    # -- the model ------------------------------------------------------------------------
    def model_ops(self, config: ModelConfig, dtype: torch.dtype) -> ModelOps:
        k = self.kernels
        grouped = None
        if k.name == "triton" and any(config.layer_is_moe(i) for i in range(config.num_layers)):
            from kernels.fused_moe import fused_experts  # routed experts as grouped matmuls

            grouped = fused_experts
        return ModelOps(k.store_kv, k.decode, k.prefill, grouped_experts=grouped)

    def forward(self, model: DecoderForCausalLM, input_ids: torch.Tensor,
                positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                ctx: ForwardContext, num_layers: int | None = None,
                quantization=None) -> torch.Tensor:
        """The model's hidden states for a step, under the forward context `ctx`."""
        with use(ctx):
            return model(input_ids, positions, kv_cache, meta, num_layers)

    def quantize_decode(self, requested: bool | None) -> bool:
        """Whether decode rows take quantized matmuls (requested None: the platform's
        default). Only the CPU has them."""
        if requested:
            raise ValueError(f"quantize_decode is a CPU path, the device is {self.device}")
        return False

    def decode_blocks(self, model, config, gguf, source, dtype, requantize: bool,
                      prefill_weights: str):
        """The blocks quantized decode rows would multiply (the CPU platform's)."""
        raise ValueError(f"quantize_decode is a CPU path, the device is {self.device}")

    def quantize_for_decode(self, model, blocks, activations: str, requantize: bool):
        raise ValueError(f"quantize_decode is a CPU path, the device is {self.device}")

    def resolve_activations(self, setting: str | None, dtype: torch.dtype) -> str | None:
        """What the decode rows' quantized matmuls multiply with (None: there are none)."""
        return None

    def invariant_rows(self, model) -> None:
        """Make the built model's matmuls give a row the same result whatever other rows
        share its call (the CPU's prefill rows: cpu/prefill_matmuls.py). Nothing elsewhere."""

    # -- settings ---------------------------------------------------------------------------
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def resolve_dtype(self, dtype: str | torch.dtype | None) -> torch.dtype:
        """`None`/"auto": the platform's default; else the named dtype, checked."""
        from engine_core.config import parse_dtype

        return self.default_dtype() if dtype in (None, "auto") else parse_dtype(dtype)

    def check_quantization(self, setting: str | None) -> str | None:
        """--quantization: None (or "none") computes the weights as loaded."""
        if setting in (None, "none"):
            return None
        raise ValueError(f"quantization={setting!r} requantizes float weights for the CPU's "
                         f"decode matmuls; on {self.device} leave it unset")

    def decode_threads(self, quantized: bool) -> int:
        """The threads a decode-only step may use at most (engine_core/thread_governor.py)."""
        return 1

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on a CPU)."""

    def use_device(self) -> None:
        """Make this device current on the calling thread (a CPU has nothing to make)."""

    def graphs_refusal(self, enforce_eager: bool) -> str | None:
        """Why decode steps run eagerly here (None: they may be captured as CUDA graphs)."""
        return f"eager (no CUDA graphs on {self.device.type})"


def select_platform(device: str | torch.device | None = None) -> Platform:
    """The platform for `device` (None: the first CUDA device where there is one, else the
    CPU); "cuda" alone names the current CUDA device, so that steps run on one named device."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        from engine_core.platforms.cuda import CudaPlatform

        return CudaPlatform(device)
    if device.type == "cpu":
        from engine_core.platforms.cpu import CpuPlatform

        return CpuPlatform(device)
    raise ValueError(f"device must be cpu or cuda, got {device}")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The dtype an engine on `device` computes in (None/"auto": the platform's default),
    without building the platform's kernels (the CLIs ask before any model loads)."""
    from engine_core.config import parse_dtype

    if dtype not in (None, "auto"):
        return parse_dtype(dtype)
    if torch.device(device).type == "cpu":
        from engine_core.platforms.cpu import cpu_default_dtype

        return cpu_default_dtype()
    return torch.bfloat16
