"""Soft-capped attention scores (Gemma 2: softcap * tanh(score / softcap) before the softmax):
the torch path, the Triton kernels and the C kernel against the reference, decode and prefill
rows, with a window too (Gemma 2's local layers have both)."""

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
CAP = 0.7  # below the scores' spread here, so the cap changes every output
WINDOWS = [None, 8]


def test_reference_cap_is_in_play() -> None:
    inputs = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, torch.float32, seed=1)
    capped = paged_decode_attention_ref(*inputs.args(), None, CAP)
    assert not torch.allclose(capped, paged_decode_attention_ref(*inputs.args()))
    # a cap far above every score is no cap
    torch.testing.assert_close(paged_decode_attention_ref(*inputs.args(), None, 1e6),
                               paged_decode_attention_ref(*inputs.args()))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_softcap(window, dtype) -> None:
    dec = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, dtype, seed=2)
    assert_close_to_reference(paged_decode_attention_torch(*dec.args(), None, window, CAP),
                              paged_decode_attention_ref(*dec.args(), window, CAP))
    pre = make_prefill_inputs(*PREFILL_CASE, 6, 2, 32, 8, dtype, seed=2)
    assert_close_to_reference(paged_prefill_attention_torch(*pre.args(), window, CAP),
                              paged_prefill_attention_ref(*pre.args(), window, CAP))


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_softcap(window, triton_device: torch.device) -> None:
    from kernels.decode_attention import paged_decode_attention_triton
    from kernels.prefill_attention import paged_prefill_attention_triton

    dec = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, torch.float32, seed=3)
    for splits in (1, 3):  # the split kernel's partial softmaxes cap the same scores
        assert_close_to_reference(
            paged_decode_attention_triton(*dec.to(triton_device).args(), window, block_n=16,
                                          num_splits=splits, softcap=CAP),
            paged_decode_attention_ref(*dec.args(), window, CAP))
    pre = make_prefill_inputs(*PREFILL_CASE, 6, 2, 32, 8, torch.float32, seed=3)
    assert_close_to_reference(
        paged_prefill_attention_triton(*pre.to(triton_device).args(), window, block_m=16,
                                       block_n=16, softcap=CAP),
        paged_prefill_attention_ref(*pre.args(), window, CAP))


@pytest.mark.parametrize("isa", native.cpu_isas())
@pytest.mark.parametrize("window", WINDOWS)
def test_c_attention_softcap(window, isa: str) -> None:
    """pd_row_attention with a cap: prefill rows (through table_of_row) and decode rows, in
    the group kernels' shapes (G 3, D 32 takes the per-head path; G 2, D 64 a group kernel)."""
    from tests.kernels.row_attention_check import check_row_attention
    from tests.native_kernels import require_native_kernels

    lib = require_native_kernels(isa)
    for heads in ((6, 2, 32), (4, 2, 64)):
        check_row_attention(lib, PREFILL_CASE, heads, window, softcap=CAP)
