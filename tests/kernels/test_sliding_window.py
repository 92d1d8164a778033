"""Sliding-window attention (Mistral, Qwen2/3 when set): the torch path and the Triton kernels
against the reference, with contexts and cached prefixes longer than the window."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.cpu_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from kernels.reference import (
    attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from tests.kernels.attention_inputs import (
    assert_close_to_reference,
    make_decode_inputs,
    make_prefill_inputs,
)
from tests.kernels.selected import paged_decode_attention, paged_prefill_attention

DTYPES = [torch.float32, torch.bfloat16]
# contexts shorter than, equal to and longer than the windows, across block boundaries
CONTEXT_LENS = [1, 7, 8, 9, 21, 40, 75]
# (query_lens, prefix_lens): a chunk after a prefix longer than the window (chunked prefill /
# prefix caching), chunks longer than the window, a single token
PREFILL_CASE = ([5, 30, 1, 17], [20, 0, 33, 9])
WINDOWS = [1, 8, 13]


def test_reference_window_is_a_band() -> None:
    """The reference itself: with V holding each key's position, window 1 returns the query's
    own position and window 2 a mix of its own and the one before."""
    q, k = torch.randn(6, 1, 4), torch.randn(6, 1, 4)
    v = torch.arange(6.0)[:, None, None].expand(6, 1, 4)
    one = attention_ref(q, k, v, torch.arange(6), 1.0, window=1)
    assert torch.equal(one[:, 0, 0], torch.arange(6.0))
    two = attention_ref(q, k, v, torch.arange(6), 1.0, window=2)[1:, 0, 0]
    assert bool(((two >= torch.arange(5.0)) & (two <= torch.arange(1.0, 6.0))).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_torch_window(window: int, dtype: torch.dtype) -> None:
    inputs = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, dtype, seed=window)
    expected = paged_decode_attention_ref(*inputs.args(), window)
    actual = paged_decode_attention_torch(*inputs.args(), None, window)
    assert_close_to_reference(actual, expected)
    full = paged_decode_attention_ref(*inputs.args())
    assert not torch.allclose(expected.float(), full.float())  # the window changed something


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_torch_window(window: int, dtype: torch.dtype) -> None:
    inputs = make_prefill_inputs(*PREFILL_CASE, 6, 2, 32, 8, dtype, seed=window)
    expected = paged_prefill_attention_ref(*inputs.args(), window)
    actual = paged_prefill_attention_torch(*inputs.args(), window)
    assert_close_to_reference(actual, expected)


def test_decode_torch_layers_of_different_windows_share_a_step() -> None:
    """One step cache, two windows (a local and a global layer): each gets its own mask."""
    inputs = make_decode_inputs(CONTEXT_LENS, 4, 4, 16, 8, torch.float32, seed=3)
    step: dict = {}
    local = paged_decode_attention_torch(*inputs.args(), step, 8)
    full = paged_decode_attention_torch(*inputs.args(), step, None)
    assert_close_to_reference(local, paged_decode_attention_ref(*inputs.args(), 8))
    assert_close_to_reference(full, paged_decode_attention_ref(*inputs.args()))


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_triton_window(window: int, triton_device: torch.device) -> None:
    from kernels.decode_attention import paged_decode_attention_triton

    inputs = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, torch.float32, seed=window)
    expected = paged_decode_attention_ref(*inputs.args(), window)
    actual = paged_decode_attention_triton(*inputs.to(triton_device).args(), window, block_n=16)
    assert_close_to_reference(actual, expected)


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_triton_window(window: int, triton_device: torch.device) -> None:
    from kernels.prefill_attention import paged_prefill_attention_triton

    inputs = make_prefill_inputs(*PREFILL_CASE, 6, 2, 32, 8, torch.float32, seed=window)
    expected = paged_prefill_attention_ref(*inputs.args(), window)
    actual = paged_prefill_attention_triton(*inputs.to(triton_device).args(), window,
                                            block_m=16, block_n=16)
    assert_close_to_reference(actual, expected)


def test_triton_gemma3_shape_window(triton_device: torch.device) -> None:
    """Gemma 3 270M's attention shape: 4 query heads on 1 KV head of head_dim 256, windowed."""
    from kernels.decode_attention import paged_decode_attention_triton
    from kernels.prefill_attention import paged_prefill_attention_triton

    dec = make_decode_inputs(CONTEXT_LENS, 4, 1, 256, 8, torch.float32, seed=5)
    assert_close_to_reference(
        paged_decode_attention_triton(*dec.to(triton_device).args(), 8, block_n=16),
        paged_decode_attention_ref(*dec.args(), 8))
    pre = make_prefill_inputs(*PREFILL_CASE, 4, 1, 256, 8, torch.float32, seed=5)
    assert_close_to_reference(
        paged_prefill_attention_triton(*pre.to(triton_device).args(), 8, block_m=16,
                                       block_n=16),
        paged_prefill_attention_ref(*pre.args(), 8))


def test_public_api_triton_window(triton_backend: torch.device) -> None:
    dec = make_decode_inputs([3, 30], 4, 2, 16, 8, torch.float32, seed=1)
    assert_close_to_reference(paged_decode_attention(*dec.to(triton_backend).args(), None, 5),
                              paged_decode_attention_ref(*dec.args(), 5))
    pre = make_prefill_inputs([4, 20], [12, 0], 4, 2, 16, 8, torch.float32, seed=1)
    assert_close_to_reference(paged_prefill_attention(*pre.to(triton_backend).args(), 5),
                              paged_prefill_attention_ref(*pre.args(), 5))


@pytest.mark.parametrize("isa", native.cpu_isas())
@pytest.mark.parametrize("window", WINDOWS)
def test_c_attention_window(window: int, isa: str) -> None:
    """The C kernel (pd_row_attention) with a window, decode rows and prefill rows (one
    row per token through table_of_row, a cached prefix longer than the window), against
    the reference; rope and K/V store as without one (tests/kernels/test_native_attention.py)."""
    from engine_core.model.rope import apply_rope, cos_sin_cache
    from kernels.reference import store_kv_ref
    from tests.native_kernels import require_native_kernels

    lib = require_native_kernels(isa)  # every build this CPU runs, as test_native_attention.py
    query_lens, prefix_lens = PREFILL_CASE
    inputs = make_prefill_inputs(query_lens, prefix_lens, 6, 2, 32, 16, torch.float32,
                                 seed=window)
    kv_layer = inputs.kv_layer.contiguous()
    meta = inputs.metadata()
    positions = meta.prefill_row_lens.long() - 1
    tables = inputs.block_tables[meta.prefill_row_tables.long()]
    slots = tables.long().gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    qkv = torch.randn(len(positions), 10 * 32, generator=torch.Generator().manual_seed(window))
    cos_sin = cos_sin_cache(32, 256, 10000.0, None)[positions]
    q, k, v = qkv.split([6 * 32, 2 * 32, 2 * 32], dim=1)
    cos, sin = cos_sin[:, None, :16], cos_sin[:, None, 16:]
    expected_cache = kv_layer.clone()
    store_kv_ref(apply_rope(k.reshape(-1, 2, 32), cos, sin), v.reshape(-1, 2, 32),
                 expected_cache, slots)
    expected = paged_prefill_attention_ref(
        apply_rope(q.reshape(-1, 6, 32), cos, sin), expected_cache, inputs.block_tables,
        inputs.query_start_loc, inputs.seq_lens, 0.2, window).reshape(len(positions), -1)
    out = native.row_attention(lib, qkv.clone(), cos_sin, kv_layer, slots,
                                  inputs.block_tables, meta.prefill_row_lens, 6, 0.2,
                                  meta.prefill_max_len, meta.prefill_row_tables, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # each sequence's last row alone, as a decode row (its own table, no table_of_row)
    last = (inputs.query_start_loc[1:] - 1).long()
    alone = native.row_attention(lib, qkv[last].clone(), cos_sin[last], kv_layer.clone(),
                                    slots[last], inputs.block_tables, inputs.seq_lens, 6, 0.2,
                                    0, None, window)
    torch.testing.assert_close(alone, expected[last], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["mistral-window", "gemma3", "gemma2"])
def test_engine_on_triton_kernels_matches_transformers(case, tmp_path, monkeypatch,
                                                        triton_backend: torch.device):
    """The engine with its attention on the Triton kernels (on the card where there is one,
    else interpreted on the CPU, the C kernels off): a tiny windowed model, prompts longer than the window, chunked prefill (16-token budget) and a
    prefix-cache hit, against transformers (tests/engine_core/arch_cases.py); Gemma 2's
    soft caps ride along into the kernels."""
    pytest.importorskip("transformers")
    from kernels import decode_attention, prefill_attention
    from tests.engine_core import tiny_models as tm
    from tests.engine_core.arch_cases import CASES, check_against_hf

    windows: list = []  # the windows the Triton kernels were called with

    def spying(fn, window_at: int):
        def spy(*args, **kwargs):
            windows.append(args[window_at] if len(args) > window_at else None)
            return fn(*args, **kwargs)
        return spy

    monkeypatch.setattr(decode_attention, "paged_decode_attention_triton",
                        spying(decode_attention.paged_decode_attention_triton, 5))
    monkeypatch.setattr(prefill_attention, "paged_prefill_attention_triton",
                        spying(prefill_attention.paged_prefill_attention_triton, 6))
    # without the C kernels, whose attention would otherwise take every layer
    monkeypatch.setattr(native, "load", lambda *args, **kwargs: None)
    config_cls, overrides = CASES[case]
    check_against_hf(tm.build_hf(config_cls, tmp_path, **overrides), tmp_path,
                     device=triton_backend)
    assert 12 in windows  # the windowed layers ran on the Triton kernels
