"""What one forward pass needs besides its tensors, set per step by whoever runs the model.

    with use(ForwardContext(num_quant_rows=nd, on_layer_done=...)):
        hidden = model(input_ids, positions, kv_cache, meta)

The model reads it with `current()`; outside a `use` block it is the empty context (every row
dense, nobody watching the layers). Fields:
- num_quant_rows: the first rows of the batch are decode rows, which take the quantized
  matmuls (the CPU platform's DecodeQuantLinear); the rest are dense.
- on_layer_done: called with each layer's index once its KV is in the cache (the KV
  connector's save_layer: the prefill worker ships that layer while the next computes). A
  forward with an observer runs every row layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardContext:
    num_quant_rows: int = 0
    on_layer_done: Callable[[int], None] | None = None


_EMPTY = ForwardContext()
_CURRENT: ContextVar[ForwardContext | None] = ContextVar("pdserve_forward_context",
                                                         default=None)


@contextmanager
def use(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current() -> ForwardContext:
    return _CURRENT.get() or _EMPTY
