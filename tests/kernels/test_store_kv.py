"""store_kv: torch path and Triton kernel against the reference, on the whole cache tensor."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.cpu_attention import store_kv_torch
from kernels.reference import store_kv_ref
from tests.kernels.selected import store_kv

NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM = 7, 3, 40



def _random_store(
    num_tokens: int, block_size: int, dtype: torch.dtype, seed: int, layer_outer: bool = True
) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(whole cache, layer index, key, value, slot_mapping) with ~1/4 of the slots = -1.

    key and value are non-contiguous views into a fused QKV projection output. With
    layer_outer=False the layer is not the outer dim of the cache, so its blocks are strided.
    """
    generator = torch.Generator().manual_seed(seed)
    if layer_outer:
        shape = (2, NUM_BLOCKS, 2, block_size, NUM_KV_HEADS, HEAD_DIM)
    else:
        shape = (NUM_BLOCKS, 2, 2, block_size, NUM_KV_HEADS, HEAD_DIM)
    cache = torch.randn(shape, generator=generator).to(dtype)
    width = NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, 3 * width, generator=generator).to(dtype)
    key = qkv[:, width : 2 * width].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, 2 * width :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=generator)[:num_tokens]
    is_pad = torch.rand(num_tokens, generator=generator) < 0.25
    slot_mapping = torch.where(is_pad, -1, slots)  # int64
    return cache, 1, key, value, slot_mapping


def _layer(cache: torch.Tensor, layer: int, layer_outer: bool) -> torch.Tensor:
    return cache[layer] if layer_outer else cache[:, layer]  # [NB, 2, bs, H, D]


def _check_store(
    fn: Callable[..., None], block_size: int, dtype: torch.dtype, device: torch.device, seed: int
) -> None:
    for layer_outer in (True, False):
        cache, layer, key, value, slot_mapping = _random_store(
            num_tokens=13, block_size=block_size, dtype=dtype, seed=seed, layer_outer=layer_outer
        )
        expected = cache.clone()
        store_kv_ref(key, value, _layer(expected, layer, layer_outer), slot_mapping)
        assert not torch.equal(expected, cache), "the test must write something"
        actual = cache.to(device)
        fn(
            key.to(device),
            value.to(device),
            _layer(actual, layer, layer_outer),
            slot_mapping.to(device),
        )
        # Whole cache, bit-exact: the right slots changed and nothing else (other layer included).
        assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_torch_matches_reference(block_size: int, dtype: torch.dtype) -> None:
    _check_store(store_kv_torch, block_size, dtype, torch.device("cpu"), seed=block_size)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_triton_matches_reference(
    block_size: int, dtype: torch.dtype, triton_device: torch.device
) -> None:
    from kernels.store_kv_triton import store_kv_triton

    _check_store(store_kv_triton, block_size, dtype, triton_device, seed=block_size + 1)


def test_store_kv_all_padding_writes_nothing(torch_backend: None) -> None:
    cache, layer, key, value, _ = _random_store(5, 8, torch.float32, seed=3)
    expected = cache.clone()
    store_kv(key, value, cache[layer], torch.full((5,), -1, dtype=torch.int64))
    assert torch.equal(cache, expected)


def test_store_kv_public_api_triton(triton_backend: torch.device) -> None:
    _check_store(store_kv, 16, torch.float32, triton_backend, seed=5)


def _store_args() -> dict[str, torch.Tensor]:
    cache, layer, key, value, slot_mapping = _random_store(6, 8, torch.float32, seed=0)
    return {"key": key, "value": value, "kv_layer": cache[layer], "slot_mapping": slot_mapping}


BAD_STORE_ARGS = [
    ("key", lambda a: a["key"][0], "key"),
    ("value", lambda a: a["value"][:, :2], "value"),
    ("value", lambda a: a["value"].to(torch.bfloat16), "value dtype"),
    ("kv_layer", lambda a: a["kv_layer"][:, 0], "kv_layer"),
    ("kv_layer", lambda a: a["kv_layer"][..., :16], "kv_layer"),
    ("slot_mapping", lambda a: a["slot_mapping"][:3], "slot_mapping"),
    ("slot_mapping", lambda a: a["slot_mapping"].float(), "slot_mapping"),
]


@pytest.mark.parametrize(("name", "mutate", "match"), BAD_STORE_ARGS)
def test_store_kv_rejects_bad_arguments(
    name: str, mutate: Callable[[dict], torch.Tensor], match: str, torch_backend: None
) -> None:
    args = _store_args()
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=match):
        store_kv(**args)


@pytest.mark.parametrize(("name", "mutate", "match"), BAD_STORE_ARGS[:3])
def test_store_kv_triton_rejects_bad_arguments(
    name: str, mutate: Callable[[dict], torch.Tensor], match: str, triton_backend: torch.device
) -> None:
    args = _store_args()
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=match):
        store_kv(**args)
