"""A test-only check that every tensor a step computes with is on the engine's device.

On a GPU, a tensor left on the host inside a step is a silent cost (an implicit copy and a
host sync when it indexes device memory) or a crash (an op that will not mix devices). With
PDSERVE_CHECK_DEVICE=1 the engine runs each step under DeviceCheck, a torch function mode
that raises DeviceMisplaced on the first op reading a tensor of more than zero dimensions
from another device. Explicit moves (`to`, `copy_`, `cpu`, `tolist`, ...) and metadata
reads (shape, dtype, ...) pass: the step's inputs are meant to cross to the device that way
(engine_core/step_inputs.py), and its outputs to come back. So does taking a view of pinned
host memory (the staging buffer's used part, sliced to be copied): pinned memory exists to
be copied from. Zero-dimension host tensors pass too: torch treats them as scalars.

On a CPU engine every tensor is on the host, so the check finds nothing there; it is on in
the GPU tests (tests/gpu), where it does.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode

ENV = "PDSERVE_CHECK_DEVICE"

# ops that move data between devices on purpose, or only read a tensor's metadata
_PASS = frozenset({
    "to", "copy_", "cpu", "cuda", "pin_memory", "is_pinned", "tolist", "item", "numpy",
    "__get__", "__set__", "size", "dim", "stride", "numel", "data_ptr", "is_contiguous",
    "element_size", "storage_offset", "untyped_storage", "__len__", "__repr__", "__format__",
    "__bool__", "__index__", "__int__", "__float__", "__hash__", "__iter__", "type",
    "get_device", "nbytes", "itemsize", "__reduce_ex__", "__setstate__", "__dlpack__",
    "__dlpack_device__", "__array__", "is_floating_point", "is_complex",
})

# views, which pass on pinned host memory (a staging buffer being sliced for its copy)
_VIEWS = frozenset({"__getitem__", "narrow", "view", "reshape", "flatten"})


def _tensors(x):
    """The tensors in an op's arguments (nested in tuples, lists and dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


class DeviceMisplaced(AssertionError):
    """An op inside a checked step read a tensor that is not on the engine's device."""


@contextlib.contextmanager
def host_side():
    """Host work a step does on purpose, left unchecked: the draws of seeded requests, whose
    generators live on the host so that a seed draws the same on any device. (Outside a
    check this changes nothing.)"""
    with torch._C.DisableTorchFunction():
        yield


def is_enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class DeviceCheck(TorchFunctionMode):
    """Raise DeviceMisplaced when an op reads a (non-scalar) tensor off `device`."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self._num_exempt = 0

    def exempt(self, fn):
        """fn, run unchecked: for what moves data off the device on purpose (the KV
        connector staging a layer for the wire)."""
        def unchecked(*args, **kwargs):
            self._num_exempt += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._num_exempt -= 1
        return unchecked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self._num_exempt and name not in _PASS:
            for t in _tensors((args, kwargs)):
                if t.dim() > 0 and not _same(t.device, self.device):
                    if name in _VIEWS and t.device.type == "cpu" and t.is_pinned():
                        continue
                    raise DeviceMisplaced(
                        f"{getattr(func, '__qualname__', name)} reads a {tuple(t.shape)} "
                        f"{t.dtype} tensor on {t.device}; the engine runs on {self.device}")
        return func(*args, **kwargs)
