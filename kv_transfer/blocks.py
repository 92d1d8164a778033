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


def gather_blocks(kv_cache: torch.Tensor, layer: int, block_ids: Sequence[int] | torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous copy of kv_cache[layer][block_ids]: [n, 2, block_size, heads, head_dim].
    block_ids may be an int64 tensor on the cache's device already (used as it is). `out`: a
    contiguous tensor of that shape, dtype and device to copy into (on the host, a buffer
    reused spares a fresh allocation's page faults, and its release's unmapping: ~0.3 ms a
    1.6 MB layer here)."""
    n = len(block_ids)
    shape = (n, *kv_cache.shape[2:])
    if out is not None and (tuple(out.shape) != shape or out.dtype != kv_cache.dtype
                            or out.device != kv_cache.device or not out.is_contiguous()):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} is not a "
                         f"contiguous {shape} {kv_cache.dtype} on {kv_cache.device}")
    rows = block_rows(kv_cache)
    if rows is None:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        if out is None:
            return kv_cache[layer].index_select(0, index)
        return torch.index_select(kv_cache[layer], 0, index, out=out)
    ids = np.asarray(block_ids)
    if n and not 0 <= ids.min() <= ids.max() < rows.shape[1]:  # take(mode="clip") would clamp
        raise IndexError(f"block ids must be in [0, {rows.shape[1]}), got {block_ids}")
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype)
    # into `out`, unbuffered (mode="raise" would gather into a temporary first)
    rows[layer].take(ids, axis=0, out=out.view(torch.uint8).view(n, -1).numpy(), mode="clip")
    return out


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
