"""Gathers and scatters of whole KV blocks of one layer.

    kv_cache[layer]                 [num_blocks, 2, block_size, num_kv_heads, head_dim]
    rows = block_rows(kv_cache)     [num_layers, num_blocks, block_nbytes] uint8, same memory
    rows[layer, b]                  block b of that layer: K then V, one contiguous run

On CPU the copies go through numpy on the uint8 row view: one memcpy per block, on the calling
thread. torch's index_select / index_copy_ do the same work on an idle machine, but they enter
the intra-op thread pool, and on this 2-core box with the other core busy (the model thread, a
neighbour) they measured 7.7 ms instead of 0.04 ms for one 786 KiB layer. CUDA tensors use
torch (a single kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def block_rows(kv_cache: torch.Tensor) -> np.ndarray | None:
    """The uint8 [num_layers, num_blocks, block_nbytes] numpy view of a contiguous CPU cache,
    or None (CUDA, or not contiguous) when torch must do the copy."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return None
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], kv_cache.shape[1], -1).numpy()


def gather_blocks(kv_cache: torch.Tensor, layer: int,
                  block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """A contiguous copy of kv_cache[layer][block_ids]: [n, 2, block_size, heads, head_dim].
    block_ids may be an int64 tensor on the cache's device already (used as it is)."""
    rows = block_rows(kv_cache)
    if rows is None:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        return kv_cache[layer].index_select(0, index)
    out = rows[layer].take(np.asarray(block_ids), axis=0)  # [n, block_nbytes] uint8
    shape = (len(block_ids), *kv_cache.shape[2:])
    return torch.from_numpy(out).view(kv_cache.dtype).view(shape)


def scatter_blocks(kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int] | torch.Tensor,
                   blocks: torch.Tensor) -> None:
    """kv_cache[layer][block_ids[i]] = blocks[i]; blocks: [n, 2, block_size, heads, head_dim].
    block_ids may be an int64 tensor on the cache's device already (used as it is)."""
    rows = block_rows(kv_cache)
    if rows is None or blocks.device.type != "cpu":
        index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        kv_cache[layer].index_copy_(0, index, blocks.to(kv_cache.device))
        return
    src = blocks.contiguous().view(torch.uint8).reshape(len(block_ids), -1).numpy()
    rows[layer][np.asarray(block_ids)] = src
