"""The checksum that proves a layer arrived intact: XXH3-64 (its low 32 bits) over the bytes of
one layer's blocks, taken in destination-block order.

    sender:   snapshot = kv_cache[layer][src_block_ids]   # [n, 2, block_size, heads, head_dim]
              xxh3(bytes of snapshot)                      # one contiguous buffer
    receiver: xxh3(kv_cache[layer][dst_block_ids[0]] ++ kv_cache[layer][dst_block_ids[1]] ++ ...)

Both are the same computation: the receiver feeds its blocks to one streaming hasher in
order, which hashes their concatenation, and snapshot block i is what lands in
dst_block_ids[i]. Being order-sensitive, it catches a block written to the wrong destination,
which an additive checksum would not. The wire's checksum fields are 32 bits (`crc32`, the
name of the CRC-32 this replaced): a corrupted layer passes with probability 2^-32.

Speed (Zen 4, one core, a 2,048-token layer of the default model in bf16, 1.57 MB): python's
xxhash 18 us, streamed block by block 28 us; zlib.crc32 226 us. Verifying a 2k-token prompt's
KV (30 layers) so costs the receiver about 1 ms, not 7, and the sender as much again. CUDA
tensors are copied to the host first (one device-to-host copy per layer).

cuda_ipc, where both ends hold the layer on a GPU, uses a checksum computed on the device
instead (`weighted_sum32`): on the H200, a host CRC-32 cost 37 ms of a 2k-token prompt's 96 ms
handoff. Each 32-bit word is split into 16-bit halves, each multiplied by an odd weight below
2^16 that depends on the word's position, and the products summed in int64 (each word adds
under 2^33; a sum that wraps does so mod 2^64, which keeps its low 32 bits exact, so any order
of the sums gives the same checksum). It is deterministic on any device,
order-sensitive (a block in the wrong destination moves its words to other weights), and any
change to one half-word changes it (an odd weight times a non-zero change below 2^16 is not
0 mod 2^32). On a GPU one fused Triton kernel computes it (kernels/weighted_sum.py), reading
the receiver's destination blocks in place; the torch code here is its reference and the CPU
path. Which checksum a transfer uses follows from its transport (Transport.checksum_kind,
transports/base.py), which both ends know, so the wire's crc32 fields carry either.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import xxhash


def host_bytes(t: torch.Tensor):
    """A uint8 numpy view of a contiguous tensor (copied to the host if it is on a GPU)."""
    if t.device.type != "cpu":
        t = t.cpu()
    assert t.is_contiguous(), "checksums are over contiguous bytes"
    return t.view(torch.uint8).reshape(-1).numpy()


def checksum_bytes(data) -> int:
    """The host checksum of a buffer (bytes, or a contiguous numpy array): 32 bits."""
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


def checksum_tensor(blocks: torch.Tensor) -> int:
    """The host checksum of a contiguous tensor's bytes, e.g. a snapshot [n, 2, block_size,
    heads, dim]."""
    return checksum_bytes(host_bytes(blocks))


# The weight of word i depends on i mod 2^16 only (i * a mod 2^16 does), so one period of
# weights serves any length; words are summed CHUNK_WORDS at a time (a multiple of the period),
# which bounds the int64 temporaries (a 32k-token prompt's layer of an 8B model is 32M words).
_PERIOD = 1 << 16
CHUNK_WORDS = 1 << 22
_WEIGHTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
_WEIGHTS_LOCK = threading.Lock()


def _weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Odd int64 weights below 2^16 for the low and high halves of words 0..2^16-1, one pair
    per device, built once and kept: sender and receiver threads read them from streams of
    their own, so the building stream is drained before any other can see them."""
    key = str(device)
    with _WEIGHTS_LOCK:
        if key not in _WEIGHTS:
            i = torch.arange(_PERIOD, dtype=torch.int64, device=device)
            pair = (((i * 40503 + 1) & 0xFFFF) | 1, ((i * 30011 + 12345) & 0xFFFF) | 1)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            _WEIGHTS[key] = pair
        return _WEIGHTS[key]


def weighted_sum32(t: torch.Tensor) -> int:
    """The device-side checksum of a tensor's bytes (see the module docstring); 32 bits."""
    t = t.contiguous()
    if t.nbytes % 4:
        raise ValueError(f"weighted_sum32 takes whole 32-bit words, got {t.nbytes} bytes")
    words32 = t.view(torch.uint8).view(torch.int32).reshape(-1)
    n = words32.numel()
    if n >= 1 << 31:
        raise ValueError("weighted_sum32 takes fewer than 2^31 words")
    if words32.is_cuda:
        from kernels.weighted_sum import weighted_sum_words  # imports triton: GPU only

        return int(weighted_sum_words(words32.view(1, n)).item()) & 0xFFFFFFFF
    return _weighted_sum32_torch(words32)


def _weighted_sum32_torch(words32: torch.Tensor) -> int:
    """The reference: torch ops over words32 [n] int32, CHUNK_WORDS at a time."""
    n = words32.numel()
    low, high = _weights(words32.device)
    total = torch.zeros((), dtype=torch.int64, device=words32.device)
    for start in range(0, n, CHUNK_WORDS):
        words = words32[start:start + CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        full = words.numel() // _PERIOD * _PERIOD
        for part, count in ((words[:full].view(-1, _PERIOD), _PERIOD),
                            (words[full:], words.numel() - full)):
            if part.numel():
                total += ((part & 0xFFFF) * low[:count]).sum() + ((part >> 16) * high[:count]).sum()
    return int(total.item()) & 0xFFFFFFFF


def checksum_tensor_as(kind: str, blocks: torch.Tensor) -> int:
    """`kind`'s checksum of a contiguous snapshot [n, 2, block_size, heads, dim]."""
    return weighted_sum32(blocks) if kind == "sum32" else checksum_tensor(blocks)


def checksum_blocks_as(kind: str, kv_layer: torch.Tensor,
                       block_ids: Sequence[int] | torch.Tensor) -> int:
    """`kind`'s checksum of kv_layer[b] for b in block_ids, in that order. block_ids may be
    an int64 tensor on the layer's device already (a receiver uploads a lease's once)."""
    if kind != "sum32":
        return checksum_blocks(kv_layer, [int(b) for b in block_ids])
    index = torch.as_tensor(block_ids, dtype=torch.long, device=kv_layer.device)
    block_nbytes = kv_layer[0].nbytes if kv_layer.shape[0] else 0
    if kv_layer.is_cuda and kv_layer.is_contiguous() and block_nbytes % 4 == 0 \
            and index.numel() * block_nbytes // 4 < 1 << 31:
        from kernels.weighted_sum import weighted_sum_words  # imports triton: GPU only

        words = kv_layer.view(torch.uint8).view(kv_layer.shape[0], -1).view(torch.int32)
        return int(weighted_sum_words(words, index).item()) & 0xFFFFFFFF
    return weighted_sum32(kv_layer.index_select(0, index))


def checksum_blocks(kv_layer: torch.Tensor, block_ids: Sequence[int]) -> int:
    """The host checksum of kv_layer[b] for b in block_ids, in that order.

    kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous
    """
    if kv_layer.device.type != "cpu":
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv_layer.device)
        return checksum_tensor(kv_layer.index_select(0, index))
    rows = host_bytes(kv_layer).reshape(kv_layer.shape[0], -1)  # [num_blocks, block bytes]
    hasher = xxhash.xxh3_64()
    for b in block_ids:
        hasher.update(rows[b])
    return hasher.intdigest() & 0xFFFFFFFF
