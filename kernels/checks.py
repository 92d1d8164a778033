"""Argument checks shared by every backend of the kernels (Triton wrappers and the torch path).

Only metadata is checked (ndim, shapes, dtypes, devices): reading tensor *values* would force a
device sync on every layer. Value preconditions (slots in range, lengths ≥ 1, block tables
covering the lengths) are documented on the public functions and exercised by the tests.
"""

from __future__ import annotations

import torch

KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_ndim(name: str, tensor: torch.Tensor, ndim: int, shape_doc: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {shape_doc}, got shape {tuple(tensor.shape)}")


def _check_index(name: str, tensor: torch.Tensor, length: int, length_doc: str) -> None:
    _check_ndim(name, tensor, 1, f"[{length_doc}]")
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.shape[0] != length:
        raise ValueError(f"{name} must have {length_doc}={length} entries, got {tensor.shape[0]}")


def _check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected {device}")


def check_kv_layer(kv_layer: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim] (layout.py)."""
    _check_ndim("kv_layer", kv_layer, 5, "[num_blocks, 2, block_size, num_kv_heads, head_dim]")
    if kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer dim 1 must be 2 (K, V), got {kv_layer.shape[1]}")
    if kv_layer.shape[3] != num_kv_heads or kv_layer.shape[4] != head_dim:
        raise ValueError(
            f"kv_layer heads/head_dim {tuple(kv_layer.shape[3:])} do not match "
            f"({num_kv_heads}, {head_dim})"
        )
    if kv_layer.dtype not in KV_DTYPES:
        raise ValueError(f"kv_layer dtype must be one of {KV_DTYPES}, got {kv_layer.dtype}")


def check_store_kv_args(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Raise ValueError naming the first bad argument of `store_kv`."""
    _check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    _check_ndim("value", value, 3, "[num_tokens, num_kv_heads, head_dim]")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check_kv_layer(kv_layer, key.shape[1], key.shape[2])
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != kv_layer.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} != kv_layer dtype {kv_layer.dtype}")
    _check_index("slot_mapping", slot_mapping, key.shape[0], "num_tokens")
    _check_device(kv_layer.device, key=key, value=value, slot_mapping=slot_mapping)


def _check_attention_common(
    query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, num_seqs: int
) -> None:
    _check_ndim("kv_layer", kv_layer, 5, "[num_blocks, 2, block_size, num_kv_heads, head_dim]")
    num_kv_heads = kv_layer.shape[3]
    check_kv_layer(kv_layer, num_kv_heads, query.shape[2])
    if num_kv_heads == 0 or query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of kv_layer heads ({num_kv_heads})"
        )
    if query.dtype != kv_layer.dtype:
        raise ValueError(f"query dtype {query.dtype} != kv_layer dtype {kv_layer.dtype}")
    _check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    if block_tables.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must have num_seqs={num_seqs} rows, got {block_tables.shape[0]}"
        )


def check_decode_args(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """Raise ValueError naming the first bad argument of `paged_decode_attention`."""
    _check_ndim("query", query, 3, "[num_seqs, num_q_heads, head_dim]")
    num_seqs = query.shape[0]
    _check_attention_common(query, kv_layer, block_tables, num_seqs)
    _check_index("context_lens", context_lens, num_seqs, "num_seqs")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    _check_device(
        kv_layer.device, query=query, block_tables=block_tables, context_lens=context_lens
    )


def check_prefill_args(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Raise ValueError naming the first bad argument of `paged_prefill_attention`."""
    _check_ndim("query", query, 3, "[num_tokens, num_q_heads, head_dim]")
    _check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    num_seqs = seq_lens.shape[0]
    _check_attention_common(query, kv_layer, block_tables, num_seqs)
    _check_index("seq_lens", seq_lens, num_seqs, "num_seqs")
    _check_index("query_start_loc", query_start_loc, num_seqs + 1, "num_seqs + 1")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    _check_device(
        kv_layer.device,
        query=query,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
