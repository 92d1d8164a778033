"""Triton kernel writing new tokens' K and V into the paged cache (layout.py).

One program per token copies that token's [num_kv_heads, head_dim] K and V tiles into

    kv_layer[slot // BLOCK_SIZE, 0 | 1, slot % BLOCK_SIZE, :, :]

A slot of -1 marks a padding token and writes nothing. All strides are passed in, so key and
value may be views (e.g. slices of a fused QKV projection) and kv_layer a layer of the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_store_kv_args
from kernels.triton_utils import launchable


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_key_dim,
    stride_value_token,
    stride_value_head,
    stride_value_dim,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_kv_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    key = tl.load(
        key_ptr
        + token * stride_key_token
        + offs_h[:, None] * stride_key_head
        + offs_d[None, :] * stride_key_dim,
        mask=mask,
    )
    value = tl.load(
        value_ptr
        + token * stride_value_token
        + offs_h[:, None] * stride_value_head
        + offs_d[None, :] * stride_value_dim,
        mask=mask,
    )
    dst = (
        kv_ptr
        + block * stride_kv_block
        + offset * stride_kv_slot
        + offs_h[:, None] * stride_kv_head
        + offs_d[None, :] * stride_kv_dim
    )  # [BLOCK_H, BLOCK_D] pointers into the K half
    tl.store(dst, key, mask=mask)
    tl.store(dst + stride_kv_kv, value, mask=mask)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton path of `backends.AttentionKernels.store_kv`; checks arguments and launches one program per token."""
    check_store_kv_args(key, value, kv_layer, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernel = launchable(_store_kv_kernel, kv_layer.device)
    kernel[(num_tokens,)](
        key,
        value,
        kv_layer,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_layer.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_layer.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
