"""Paged decode attention: torch path and Triton kernel against the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_attention import _flat_rows, paged_decode_attention_torch
from kernels.reference import paged_decode_attention_ref
from tests.helpers import torch_threads
from tests.kernels.attention_inputs import (
    DecodeInputs,
    assert_close_to_reference,
    make_decode_inputs,
)
from tests.kernels.selected import paged_decode_attention

# (num_q_heads, num_kv_heads): GQA ratios 1, 3 and 4.
HEADS = [(4, 4), (6, 2), (8, 2)]
DTYPES = [torch.float32, torch.bfloat16]


def context_lens_cases(block_size: int) -> list[list[int]]:
    """Lengths around block boundaries, including 1 and block_size + 1."""
    return [
        [1],
        [block_size + 1],
        [1, block_size, block_size + 1, 3 * block_size + 5, 2],
        [37, 100, 64, 5, 81, 19],
    ]


def _decode_inputs(
    context_lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int, dtype, seed
) -> DecodeInputs:
    return make_decode_inputs(context_lens, *heads, head_dim, block_size, dtype, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", range(4))
def test_decode_torch_matches_reference(
    case: int, heads: tuple[int, int], block_size: int, dtype: torch.dtype
) -> None:
    context_lens = context_lens_cases(block_size)[case]
    inputs = _decode_inputs(context_lens, heads, 64, block_size, dtype, seed=case * 7 + block_size)
    expected = paged_decode_attention_ref(*inputs.args())
    actual = paged_decode_attention_torch(*inputs.args())
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert_close_to_reference(actual, expected)


def test_decode_torch_strided_layer_and_int64_tables() -> None:
    """A layer view whose blocks are not mergeable into rows takes the indexing fallback."""
    inputs = _decode_inputs([9, 30, 1], (6, 2), 32, 8, torch.float32, seed=11)
    cache = torch.stack((inputs.kv_layer, torch.zeros_like(inputs.kv_layer)), dim=1)
    strided_layer = cache[:, 0]  # [NB, 2, bs, H, D] with block stride 2x the block size
    assert _flat_rows(strided_layer) is None
    args = (inputs.query, strided_layer, inputs.block_tables.long(), inputs.context_lens, 0.3)
    expected = paged_decode_attention_ref(*args)
    assert_close_to_reference(paged_decode_attention_torch(*args), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", HEADS)
def test_decode_triton_matches_reference(
    heads: tuple[int, int], block_size: int, dtype: torch.dtype, triton_device: torch.device
) -> None:
    from kernels.decode_attention import paged_decode_attention_triton

    context_lens = [1, block_size + 1, 2 * block_size + 3]
    inputs = _decode_inputs(context_lens, heads, 40, block_size, dtype, seed=block_size)
    expected = paged_decode_attention_ref(*inputs.args())
    actual = paged_decode_attention_triton(*inputs.to(triton_device).args(), block_n=16)
    assert actual.dtype == dtype
    assert_close_to_reference(actual, expected)


@pytest.mark.parametrize(("block_n", "num_warps", "num_stages"),
                         [(32, 2, 1), (64, 8, 4), (128, 4, 2)])
def test_decode_triton_launch_options(
    block_n: int, num_warps: int, num_stages: int, triton_device: torch.device
) -> None:
    """The launch choices bench_gpu.py --sweep times give the same attention (on a card each
    compiles; the interpreter ignores warps and stages but walks the tile)."""
    from kernels.decode_attention import paged_decode_attention_triton

    inputs = _decode_inputs([1, 150, 33], (8, 2), 64, 16, torch.bfloat16, seed=5)
    expected = paged_decode_attention_ref(*inputs.args())
    actual = paged_decode_attention_triton(*inputs.to(triton_device).args(), block_n=block_n,
                                           num_warps=num_warps, num_stages=num_stages)
    assert_close_to_reference(actual, expected)


def test_decode_public_api_triton(triton_backend: torch.device) -> None:
    inputs = _decode_inputs([3, 20], (6, 2), 32, 16, torch.float32, seed=1)
    expected = paged_decode_attention_ref(*inputs.args())
    assert_close_to_reference(paged_decode_attention(*inputs.to(triton_backend).args()), expected)


def _decode_kwargs() -> dict:
    inputs = _decode_inputs([3, 20], (6, 2), 32, 8, torch.float32, seed=0)
    names = ("query", "kv_layer", "block_tables", "context_lens", "scale")
    return dict(zip(names, inputs.args(), strict=True))


BAD_DECODE_ARGS = [
    ("query", lambda a: a["query"][0], "query"),
    ("query", lambda a: a["query"][:, :5], "query heads"),
    ("query", lambda a: a["query"].to(torch.bfloat16), "query dtype"),
    ("query", lambda a: a["query"][..., :16], "kv_layer heads/head_dim"),
    ("kv_layer", lambda a: a["kv_layer"][0], "kv_layer"),
    ("kv_layer", lambda a: torch.cat([a["kv_layer"]] * 2, dim=1), "kv_layer dim 1"),
    ("block_tables", lambda a: a["block_tables"][0], "block_tables"),
    ("block_tables", lambda a: a["block_tables"][:1], "block_tables"),
    ("block_tables", lambda a: a["block_tables"].float(), "block_tables"),
    ("context_lens", lambda a: a["context_lens"][:1], "context_lens"),
    ("context_lens", lambda a: a["context_lens"].float(), "context_lens"),
    ("scale", lambda a: 0.0, "scale"),
]


@pytest.mark.parametrize(("name", "mutate", "match"), BAD_DECODE_ARGS)
def test_decode_rejects_bad_arguments(
    name: str, mutate: Callable[[dict], object], match: str, torch_backend: None
) -> None:
    kwargs = _decode_kwargs()
    kwargs[name] = mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**kwargs)


@pytest.mark.parametrize(("name", "mutate", "match"), BAD_DECODE_ARGS[::3])
def test_decode_triton_rejects_bad_arguments(
    name: str, mutate: Callable[[dict], object], match: str, triton_backend: torch.device
) -> None:
    kwargs = _decode_kwargs()
    kwargs[name] = mutate(kwargs)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**kwargs)


@pytest.mark.parametrize("max_gather_bytes", [1, 120_000])  # 1 and 2 sequences per group
def test_decode_torch_in_sequence_groups(
    max_gather_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large batches are split into groups of sequences (1 and several per group here)."""
    monkeypatch.setattr(cpu_attention, "MAX_GATHER_BYTES", max_gather_bytes)
    inputs = _decode_inputs([37, 1, 100, 17, 64], (6, 2), 32, 8, torch.float32, seed=21)
    assert len(cpu_attention.sequence_chunks(5, 2 * 100 * 2 * 32 * 4)) > 1
    expected = paged_decode_attention_ref(*inputs.args())
    assert_close_to_reference(paged_decode_attention_torch(*inputs.args()), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_decode_torch_is_batch_invariant(seed: int, dtype: torch.dtype) -> None:
    """A sequence's output is bit for bit the same alone or in any batch, at any row: the
    continuous-batching guarantee behind "batched tokens equal one-at-a-time tokens". On one
    thread, as every worker runs (see `_decode` for why more threads round differently)."""
    with torch_threads(1):
        _check_batch_invariance(seed, dtype)


def _check_batch_invariance(seed: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(seed)
    context_lens = torch.randint(1, 300, (7,), generator=generator).tolist()
    context_lens[0] = cpu_attention.DECODE_CHUNK + 1  # one key into a second chunk
    inputs = _decode_inputs(context_lens, (9, 3), 64, 16, dtype, seed=seed)
    batched = paged_decode_attention_torch(*inputs.args())
    order = torch.randperm(len(context_lens), generator=generator)
    permuted = paged_decode_attention_torch(
        inputs.query[order], inputs.kv_layer, inputs.block_tables[order],
        inputs.context_lens[order], inputs.scale)
    assert torch.equal(permuted, batched[order])
    for s in range(len(context_lens)):
        alone = paged_decode_attention_torch(
            inputs.query[s : s + 1], inputs.kv_layer, inputs.block_tables[s : s + 1],
            inputs.context_lens[s : s + 1], inputs.scale)
        assert torch.equal(alone[0], batched[s]), f"sequence {s} ({context_lens[s]} keys)"
