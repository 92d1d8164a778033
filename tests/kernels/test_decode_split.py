"""Split-K paged decode attention (kernels/decode_split.py): each context split into chunks
walked by separate programs, then combined, against the reference. Uneven splits (contexts not
divisible by the split), empty splits (more splits than a short context has tiles), GQA,
windows, head_dim 256 and bf16; plus the choice of the number of splits."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_split
from kernels.reference import paged_decode_attention_ref
from tests.kernels.attention_inputs import assert_close_to_reference, make_decode_inputs

# 1 and 7: shorter than one 16-position tile, so every split past the first is empty;
# 37 and 50: splits of uneven length, the last one partial
CONTEXT_LENS = [1, 7, 37, 50]


def _split_attention(inputs, device, num_splits: int, window: int | None = None):
    from kernels.decode_attention import paged_decode_attention_triton

    return paged_decode_attention_triton(*inputs.to(device).args(), window, block_n=16,
                                         num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_matches_reference(num_splits: int, triton_device: torch.device) -> None:
    inputs = make_decode_inputs(CONTEXT_LENS, 6, 2, 32, 8, torch.float32, seed=num_splits)
    expected = paged_decode_attention_ref(*inputs.args())
    assert_close_to_reference(_split_attention(inputs, triton_device, num_splits), expected)


def test_split_more_splits_than_tiles(triton_device: torch.device) -> None:
    """8 splits of contexts of 1 to 20 positions: most splits are empty and weigh nothing."""
    inputs = make_decode_inputs([1, 3, 20], 4, 4, 16, 16, torch.float32, seed=2)
    expected = paged_decode_attention_ref(*inputs.args())
    assert_close_to_reference(_split_attention(inputs, triton_device, 8), expected)


def test_split_bf16_gqa4(triton_device: torch.device) -> None:
    inputs = make_decode_inputs(CONTEXT_LENS, 8, 2, 32, 16, torch.bfloat16, seed=4)
    expected = paged_decode_attention_ref(*inputs.args())
    actual = _split_attention(inputs, triton_device, 3)
    assert actual.dtype == torch.bfloat16
    assert_close_to_reference(actual, expected)


@pytest.mark.parametrize("window", [8, 13])
def test_split_window(window: int, triton_device: torch.device) -> None:
    """The window's span, not the whole context, is what gets split."""
    inputs = make_decode_inputs([1, 9, 21, 75], 6, 2, 32, 8, torch.float32, seed=window)
    expected = paged_decode_attention_ref(*inputs.args(), window)
    assert_close_to_reference(_split_attention(inputs, triton_device, 3, window), expected)


def test_split_gemma3_shape(triton_device: torch.device) -> None:
    """4 query heads on 1 KV head of head_dim 256, windowed, split in 2."""
    inputs = make_decode_inputs([5, 40], 4, 1, 256, 8, torch.float32, seed=5)
    expected = paged_decode_attention_ref(*inputs.args(), 24)
    assert_close_to_reference(_split_attention(inputs, triton_device, 2, 24), expected)


def test_split_rejects_zero_splits(triton_device: torch.device) -> None:
    inputs = make_decode_inputs([3], 2, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        _split_attention(inputs, triton_device, 0)


def test_num_context_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under one wave, enough programs for PROGRAMS_PER_SM per SM on a 132-SM card, from
    shapes alone; the default is auto, and a number overrides it."""
    monkeypatch.setattr(decode_split, "_sm_count", lambda index: 132)
    monkeypatch.delenv(decode_split.ENV, raising=False)
    cuda = torch.device("cuda", 0)
    assert decode_split.num_context_splits(32, 3, cuda) == 6  # 96 programs -> 576
    assert decode_split.num_context_splits(32, 8, cuda) == 1  # 256 programs: over a wave
    assert decode_split.num_context_splits(44, 3, cuda) == 1  # 132: exactly one wave
    assert decode_split.num_context_splits(1, 1, cuda) == decode_split.MAX_SPLITS
    assert decode_split.num_context_splits(512, 8, cuda) == 1  # already 4096 programs
    monkeypatch.setenv(decode_split.ENV, "1")
    assert decode_split.num_context_splits(32, 3, cuda) == 1
    monkeypatch.setenv(decode_split.ENV, "auto")
    assert decode_split.num_context_splits(32, 3, cuda, window=100) == 1  # too short to split
    assert decode_split.num_context_splits(32, 3, cuda, window=300) == 3
    assert decode_split.num_context_splits(32, 3, cuda, max_context_len=20) == 1
    assert decode_split.num_context_splits(32, 3, cuda, max_context_len=2048) == 6
    assert decode_split.num_context_splits(32, 3, torch.device("cpu")) == 1
