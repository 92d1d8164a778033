"""Paged prefill attention: torch path and Triton kernel against the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_attention import paged_prefill_attention_torch
from kernels.reference import paged_prefill_attention_ref
from tests.kernels.attention_inputs import (
    PrefillInputs,
    assert_close_to_reference,
    make_prefill_inputs,
)
from tests.kernels.selected import paged_decode_attention, paged_prefill_attention

HEADS = [(4, 4), (6, 2), (8, 2)]  # GQA ratios 1, 3, 4
DTYPES = [torch.float32, torch.bfloat16]


def prefill_cases(block_size: int) -> list[tuple[list[int], list[int]]]:
    """(query_lens, prefix_lens): one/many sequences, with and without a cached prefix."""
    bs = block_size
    return [
        ([7], [0]),  # single sequence, no prefix
        ([bs + 1], [bs + 1]),  # single sequence after a cached prefix
        ([1, bs + 1, 9], [0, 0, 0]),  # varlen, no prefix (causal fast path)
        ([1, bs + 1, 3, 20], [bs + 1, 0, 1, 2 * bs]),  # varlen, mixed prefixes
        ([1, 1, 1], [0, 5, 3 * bs]),  # decode-like steps
    ]


def _prefill_inputs(
    case: tuple[list[int], list[int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> PrefillInputs:
    query_lens, prefix_lens = case
    return make_prefill_inputs(
        query_lens, prefix_lens, *heads, head_dim, block_size, dtype, seed=seed
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", range(5))
def test_prefill_torch_matches_reference(
    case: int, heads: tuple[int, int], block_size: int, dtype: torch.dtype
) -> None:
    inputs = _prefill_inputs(
        prefill_cases(block_size)[case], heads, 64, block_size, dtype, seed=case * 5 + block_size
    )
    expected = paged_prefill_attention_ref(*inputs.args())
    actual = paged_prefill_attention_torch(*inputs.args())
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert_close_to_reference(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_triton_matches_reference(
    heads: tuple[int, int], block_size: int, dtype: torch.dtype, triton_device: torch.device
) -> None:
    from kernels.prefill_attention import paged_prefill_attention_triton

    case = ([1, block_size + 1, 18], [block_size + 1, 0, 3])
    inputs = _prefill_inputs(case, heads, 40, block_size, dtype, seed=block_size)
    expected = paged_prefill_attention_ref(*inputs.args())
    actual = paged_prefill_attention_triton(
        *inputs.to(triton_device).args(), block_m=16, block_n=16
    )
    assert actual.dtype == dtype
    assert_close_to_reference(actual, expected)


def test_prefill_public_api_triton(triton_backend: torch.device) -> None:
    inputs = _prefill_inputs(([5, 2], [0, 9]), (6, 2), 32, 8, torch.float32, seed=2)
    expected = paged_prefill_attention_ref(*inputs.args())
    actual = paged_prefill_attention(*inputs.to(triton_backend).args())
    assert_close_to_reference(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_single_tokens_equals_decode(dtype: torch.dtype, torch_backend: None) -> None:
    """q_len == 1 everywhere: prefill over seq_lens is decode over context_lens = seq_lens."""
    inputs = _prefill_inputs(([1, 1, 1, 1], [0, 7, 16, 40]), (6, 2), 64, 8, dtype, seed=4)
    prefill = paged_prefill_attention(*inputs.args())
    decode = paged_decode_attention(
        inputs.query, inputs.kv_layer, inputs.block_tables, inputs.seq_lens, inputs.scale
    )
    assert_close_to_reference(prefill, decode)


def test_prefill_triton_with_single_tokens_equals_decode(triton_backend: torch.device) -> None:
    inputs = _prefill_inputs(([1, 1, 1], [0, 7, 20]), (6, 2), 32, 8, torch.float32, seed=6)
    inputs = inputs.to(triton_backend)
    prefill = paged_prefill_attention(*inputs.args())
    decode = paged_decode_attention(
        inputs.query, inputs.kv_layer, inputs.block_tables, inputs.seq_lens, inputs.scale
    )
    assert_close_to_reference(prefill, decode)


def _prefill_kwargs() -> dict:
    inputs = _prefill_inputs(([3, 5], [2, 0]), (6, 2), 32, 8, torch.float32, seed=0)
    names = ("query", "kv_layer", "block_tables", "query_start_loc", "seq_lens", "scale")
    return dict(zip(names, inputs.args(), strict=True))


BAD_PREFILL_ARGS = [
    ("query", lambda a: a["query"][0], "query"),
    ("query", lambda a: a["query"][:, :5], "query heads"),
    ("query", lambda a: a["query"].to(torch.float16), "query dtype"),
    ("kv_layer", lambda a: a["kv_layer"][..., :8], "kv_layer"),
    ("block_tables", lambda a: a["block_tables"][:1], "block_tables"),
    ("query_start_loc", lambda a: a["query_start_loc"][:2], "query_start_loc"),
    ("query_start_loc", lambda a: a["query_start_loc"].float(), "query_start_loc"),
    ("seq_lens", lambda a: a["seq_lens"][:, None], "seq_lens"),
    ("scale", lambda a: -1.0, "scale"),
]


@pytest.mark.parametrize(("name", "mutate", "match"), BAD_PREFILL_ARGS)
def test_prefill_rejects_bad_arguments(
    name: str, mutate: Callable[[dict], object], match: str, torch_backend: None
) -> None:
    kwargs = _prefill_kwargs()
    kwargs[name] = mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**kwargs)


@pytest.mark.parametrize(("name", "mutate", "match"), BAD_PREFILL_ARGS[::3])
def test_prefill_triton_rejects_bad_arguments(
    name: str, mutate: Callable[[dict], object], match: str, triton_backend: torch.device
) -> None:
    kwargs = _prefill_kwargs()
    kwargs[name] = mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**kwargs)


@pytest.mark.parametrize("max_gather_bytes", [1, 40_000])  # 1 and 2 sequences per group
def test_prefill_torch_in_sequence_groups(
    max_gather_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large batches are split into groups of sequences (1 and several per group here)."""
    monkeypatch.setattr(cpu_attention, "MAX_GATHER_BYTES", max_gather_bytes)
    case = ([1, 9, 3, 20, 6], [17, 0, 1, 16, 0])
    inputs = _prefill_inputs(case, (6, 2), 32, 8, torch.float32, seed=22)
    assert len(cpu_attention.sequence_chunks(5, 2 * 36 * 2 * 32 * 4)) > 1
    expected = paged_prefill_attention_ref(*inputs.args())
    assert_close_to_reference(paged_prefill_attention_torch(*inputs.args()), expected)
