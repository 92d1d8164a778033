"""A gated MLP's prefill rows in slabs (SlabbedMLP), where its projections multiply rows in
blocked calls (prefill_matmuls.py): the same calls, bit for bit, with a slab's intermediate
rows in cache instead of a whole step's in memory."""

from __future__ import annotations

import torch
from torch import nn

from engine_core.model.feed_forward import MLP
from engine_core.model.forward_context import current
from engine_core.platforms.cpu.prefill_matmuls import BLOCK_ROWS, RowBlockedLinear


class SlabbedMLP(MLP):
    """A gated MLP whose prefill rows go through it `slab_rows` at a time (the most rows per
    call of its blocked projections, a multiple of each's): the same calls of the same rows
    as one pass, bit for bit, without a whole step's gate and up outputs (2 x intermediate
    per row) built, joined and read again by the activation; a slab's stay in cache. A step
    with decode rows on the quantized path (the forward context's num_quant_rows) takes one
    pass: those rows must come first in each projection's call."""

    slab_rows = BLOCK_ROWS[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, b = x.shape[0], self.slab_rows
        if x.dim() != 2 or m <= b or current().num_quant_rows:
            return super().forward(x)
        first = super().forward(x[:b])
        out = first.new_empty((m, first.shape[1]))
        out[:b] = first
        for i in range(b, m, b):
            out[i:i + b] = super().forward(x[i:i + b])
        return out


def slab_mlps(model: nn.Module) -> int:
    """Make each gated MLP with a blocked projection (RowBlockedLinear, as itself or as the
    dense half of a DecodeQuantLinear) a SlabbedMLP; returns how many."""
    turned = 0
    for module in model.modules():
        if type(module) is not MLP:
            continue
        rows = [d.rows for d in (getattr(p, "dense", p) for p in (module.gate_up_proj,
                                                                  module.down_proj))
                if isinstance(d, RowBlockedLinear)]
        if rows and all(max(rows) % r == 0 for r in rows):
            module.__class__ = SlabbedMLP
            module.slab_rows = max(rows)
            turned += 1
    return turned
