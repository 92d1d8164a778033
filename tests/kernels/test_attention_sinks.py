"""Attention sinks (GPT-OSS: a learned logit per query head beside its scores in the softmax,
with no value): the torch path, the Triton kernels (split decode included) and the C kernel
against the reference, decode and prefill rows, with a window too (GPT-OSS's windowed layers
have both)."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.cpu_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from tests.kernels.attention_inputs import (
    assert_close_to_reference,
    make_decode_inputs,
    make_prefill_inputs,
)

CONTEXT_LENS = [1, 7, 9, 21, 40]
PREFILL_CASE = ([5, 30, 1, 17], [20, 0, 33, 9])
WINDOWS = [None, 8]


def sinks_for(num_heads: int) -> torch.Tensor:
    """One sink per head, from well below to above the scores here, so that each takes from
    a few percent to most of its head's probability."""
    return torch.linspace(-2.0, 3.0, num_heads)


def test_reference_sinks_are_in_play() -> None:
    inputs = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, torch.float32, seed=1)
    sunk = paged_decode_attention_ref(*inputs.args(), None, None, sinks_for(6))
    plain = paged_decode_attention_ref(*inputs.args())
    assert not torch.allclose(sunk, plain)
    # a sink only scales each head's output down, by 1 / (1 + e^sink / sum e^score)
    ratio = (sunk / plain)[..., 0]
    torch.testing.assert_close(sunk, plain * ratio[..., None], rtol=1e-4, atol=1e-5)
    assert bool((ratio < 1).all() and (ratio > 0).all())
    # a sink far below every score is no sink
    torch.testing.assert_close(
        paged_decode_attention_ref(*inputs.args(), None, None, torch.full((6,), -1e4)), plain)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_sinks(window, dtype) -> None:
    sinks = sinks_for(6)
    dec = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, dtype, seed=2)
    assert_close_to_reference(
        paged_decode_attention_torch(*dec.args(), None, window, None, sinks),
        paged_decode_attention_ref(*dec.args(), window, None, sinks))
    pre = make_prefill_inputs(*PREFILL_CASE, 6, 2, 32, 8, dtype, seed=2)
    assert_close_to_reference(paged_prefill_attention_torch(*pre.args(), window, None, sinks),
                              paged_prefill_attention_ref(*pre.args(), window, None, sinks))


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_sinks(window, triton_device: torch.device) -> None:
    from kernels.decode_attention import paged_decode_attention_triton
    from kernels.prefill_attention import paged_prefill_attention_triton

    sinks = sinks_for(6)
    dec = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, torch.float32, seed=3)
    for splits in (1, 3):  # the sink joins split 0 only, so the combine counts it once
        assert_close_to_reference(
            paged_decode_attention_triton(*dec.to(triton_device).args(), window, block_n=16,
                                          num_splits=splits, sinks=sinks.to(triton_device)),
            paged_decode_attention_ref(*dec.args(), window, None, sinks))
    pre = make_prefill_inputs(*PREFILL_CASE, 6, 2, 32, 8, torch.float32, seed=3)
    assert_close_to_reference(
        paged_prefill_attention_triton(*pre.to(triton_device).args(), window, block_m=16,
                                       block_n=16, sinks=sinks.to(triton_device)),
        paged_prefill_attention_ref(*pre.args(), window, None, sinks))


@pytest.mark.parametrize("isa", native.cpu_isas())
@pytest.mark.parametrize("window", WINDOWS)
def test_c_attention_sinks(window, isa: str) -> None:
    """pd_row_attention with sinks: prefill rows (through table_of_row) and decode rows, on
    the per-head path (G 3, D 32) and the group kernels' (G 2, D 64; GPT-OSS's G 8, D 64);
    sinks of the wrong shape are refused."""
    from tests.kernels.row_attention_check import check_row_attention
    from tests.native_kernels import require_native_kernels

    lib = require_native_kernels(isa)
    for heads in ((6, 2, 32), (4, 2, 64), (8, 1, 64)):
        check_row_attention(lib, PREFILL_CASE, heads, window, sinks=sinks_for)
    qkv = torch.zeros(1, 8 * 32)
    with pytest.raises(ValueError, match=r"sinks float32 \[num_heads\]"):
        native.row_attention(lib, qkv, torch.zeros(1, 32), torch.zeros(4, 2, 16, 2, 32),
                             torch.zeros(1, dtype=torch.int64),
                             torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32), 4, 0.2, 0,
                             sinks=sinks_for(3))
