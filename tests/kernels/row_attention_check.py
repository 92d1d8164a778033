"""The C kernel's row attention (pd_row_attention) against the reference on one case: the
rows of prefill chunks through table_of_row, then each sequence's last row as a decode row
over its own table, with the features under test (a window, a soft cap, sinks)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_core.model.rope import apply_rope, cos_sin_cache
from kernels import native
from kernels.reference import paged_prefill_attention_ref, store_kv_ref
from tests.kernels.attention_inputs import make_prefill_inputs

BLOCK = 16
SCALE = 0.2


def check_row_attention(lib, case: tuple[list[int], list[int]], heads: tuple[int, int, int],
                        window: int | None = None, softcap: float | None = None,
                        sinks: Callable[[int], torch.Tensor] | None = None) -> None:
    """case: make_prefill_inputs' query and prefix lengths; heads: (Hq, Hkv, D); sinks: the
    sinks of Hq heads (None: none)."""
    hq, hkv, d = heads
    head_sinks = None if sinks is None else sinks(hq)
    inputs = make_prefill_inputs(*case, hq, hkv, d, BLOCK, torch.float32, seed=4)
    kv_layer = inputs.kv_layer.contiguous()
    meta = inputs.metadata()
    positions = meta.prefill_row_lens.long() - 1
    tables = inputs.block_tables[meta.prefill_row_tables.long()]
    slots = (tables.long().gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK
             + positions % BLOCK)
    qkv = torch.randn(len(positions), (hq + 2 * hkv) * d,
                      generator=torch.Generator().manual_seed(4))
    cos_sin = cos_sin_cache(d, 256, 10000.0, None)[positions]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    cos, sin = cos_sin[:, None, :d // 2], cos_sin[:, None, d // 2:]
    expected_cache = kv_layer.clone()
    store_kv_ref(apply_rope(k.reshape(-1, hkv, d), cos, sin), v.reshape(-1, hkv, d),
                 expected_cache, slots)
    expected = paged_prefill_attention_ref(
        apply_rope(q.reshape(-1, hq, d), cos, sin), expected_cache, inputs.block_tables,
        inputs.query_start_loc, inputs.seq_lens, SCALE, window, softcap,
        head_sinks).reshape(len(positions), -1)
    out = native.row_attention(lib, qkv.clone(), cos_sin, kv_layer, slots, inputs.block_tables,
                               meta.prefill_row_lens, hq, SCALE, meta.prefill_max_len,
                               meta.prefill_row_tables, window, softcap, head_sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    last = (inputs.query_start_loc[1:] - 1).long()  # as decode rows, their own tables
    alone = native.row_attention(lib, qkv[last].clone(), cos_sin[last], kv_layer.clone(),
                                 slots[last], inputs.block_tables, inputs.seq_lens, hq, SCALE,
                                 0, None, window, softcap, head_sinks)
    torch.testing.assert_close(alone, expected[last], atol=1e-5, rtol=1e-4)
