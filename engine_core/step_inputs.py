"""A step's integer inputs, from host arrays to the engine's device in one copy.

On CPU the arrays are wrapped as they are (no copy). On CUDA they are packed into one pinned
int64 staging buffer and copied with `non_blocking=True`, so building a step costs one
host-to-device transfer and no synchronisation; int32 inputs are cast on the device.
Everything the host needs to know about the step (lengths, maxima) it already has in the
arrays: nothing is read back.

The staging buffer is reused by the next step; an event recorded after each copy is waited on
before it is overwritten, so a copy still in flight is never clobbered.
"""

from __future__ import annotations

import numpy as np
import torch


def pack(arrays: dict[str, np.ndarray], out: np.ndarray) -> list[tuple[str, int, tuple, np.dtype]]:
    """Write the arrays one after another into `out` (int64, large enough); their layout."""
    layout, offset = [], 0
    for name, a in arrays.items():
        out[offset:offset + a.size] = a.reshape(-1)
        layout.append((name, offset, a.shape, a.dtype))
        offset += a.size
    return layout


def unpack(flat: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    """Views of `flat` (int64, on any device) shaped and typed as `pack` recorded."""
    out = {}
    for name, offset, shape, dtype in layout:
        n = int(np.prod(shape, dtype=np.int64))
        t = flat[offset:offset + n].view(shape)
        out[name] = t if dtype == np.int64 else t.to(torch.from_numpy(np.empty(0, dtype)).dtype)
    return out


def total_size(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.size for a in arrays.values())


class StepUploader:
    """Moves each step's host arrays to `device` (see the module docstring)."""

    def __init__(self, device: torch.device, staged: bool = False) -> None:
        """staged: through one pinned host buffer, copied asynchronously (the platform's
        pin_memory: a CUDA device); else the arrays are the tensors (a CPU's)."""
        self.device = torch.device(device)
        self.staged = staged
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        if not self.staged:
            return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
        size = total_size(arrays)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the staging buffer
        if self._staging is None or self._staging.numel() < size:
            self._staging = torch.empty(max(size, 2 * (0 if self._staging is None
                                                       else self._staging.numel()), 4096),
                                        dtype=torch.int64, pin_memory=True)
        layout = pack(arrays, self._staging.numpy())
        flat = self._staging[:size].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return unpack(flat, layout)
