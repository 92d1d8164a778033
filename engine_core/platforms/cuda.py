"""The CUDA platform: Triton's attention kernels (kernels/*_attention.py, store_kv_triton.py),
routed experts as grouped matmuls (kernels/fused_moe.py), pinned host staging with
asynchronous copies, decode steps captured as CUDA graphs (engine_core/decode_graphs.py), and
asynchronous scheduling by default (engine_core/async_step.py)."""

from __future__ import annotations

import torch

from engine_core.platforms import Platform


class CudaPlatform(Platform):
    name = "cuda"
    pin_memory = True
    kv_in_host_memory = False
    cuda_graphs = True
    async_scheduling = True

    def __init__(self, device: torch.device) -> None:
        if device.index is None:  # "cuda": the current device, named so that steps use it
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def use_device(self) -> None:
        """Streams, events and Triton launches without a device of their own take the
        current one, which is per thread (0 unless set), and steps may run on another thread
        than the one that built the engine."""
        torch.cuda.set_device(self.device)

    def graphs_refusal(self, enforce_eager: bool) -> str | None:
        if enforce_eager:
            return "eager (enforce_eager)"
        # the torch path reads lengths back, and routes a mixture of experts' rows from the
        # host: not capturable (on triton, the experts are grouped matmuls: kernels/fused_moe)
        if self.kernels.name != "triton":
            return (f"eager (attention backend {self.kernels.name!r}: CUDA graphs need "
                    "'triton')")
        return None
