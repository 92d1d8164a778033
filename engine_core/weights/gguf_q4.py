"""The 4-bit GGUF tensors (Q4_0, Q4_1) as integers plus per-group scale and zero.

llama.cpp stores 32 weights per block, each block a header and 16 bytes of nibbles:

    Q4_0: [d: f16][qs: 16 x u8]           w = d * (q - 8)
    Q4_1: [d: f16][m: f16][qs: 16 x u8]   w = d * q + m
    qs[j] & 0xF is weight j of the block, qs[j] >> 4 is weight j + 16.

Both are kept in the file's form, w = (q - offset) * d + m with q in 0..15 (offset 8 and m 0
for Q4_0, offset 0 for Q4_1), so an expanded weight equals gguf's dequantization bit for bit.
`scale`/`zero` give the form torch's CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`)
wants, w = (q - 8) * scale + zero.

Q4_K has the same form per group of 32: a 256-weight super-block holds f16 d and dmin and
eight 6-bit (scale, min) pairs, and weight j of group g is (d * scale_g) * q_j - dmin * min_g
with q_j in 0..15. So it is kept as q with per-group d = d * scale_g and m = -dmin * min_g,
which expands to gguf's own dequantization bit for bit (the 6-bit pairs are unpacked by
gguf's own `Q4_K.get_scale_min`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

GROUP_SIZE = 32
Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)


@dataclass
class Q4Weight:
    """A [out_features, in_features] weight as 4-bit integers and per-group d and m."""

    q: torch.Tensor  # [N, K] uint8, values 0..15
    d: torch.Tensor  # [N, K // 32] float32
    m: torch.Tensor  # [N, K // 32] float32
    offset: torch.Tensor  # [N] float32: 8 (Q4_0) or 0 (Q4_1)

    @property
    def scale(self) -> torch.Tensor:  # [N, K // 32]
        return self.d

    @property
    def zero(self) -> torch.Tensor:  # [N, K // 32]: (q - 8) * d + zero == (q - offset) * d + m
        return self.m + (8 - self.offset[:, None]) * self.d

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        d = self.d.repeat_interleave(GROUP_SIZE, dim=1)
        m = self.m.repeat_interleave(GROUP_SIZE, dim=1)
        return (self.q.float() - self.offset[:, None]) * d + m

    def permute_rows(self, index: torch.Tensor) -> Q4Weight:
        return Q4Weight(self.q[index], self.d[index], self.m[index], self.offset[index])

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        """Stack weights along the output dimension (fused q/k/v or gate/up projections)."""
        return Q4Weight(*(torch.cat([getattr(p, f) for p in parts])
                          for f in ("q", "d", "m", "offset")))

    def packed_nibbles(self) -> torch.Tensor:  # [N, K // 32, 16] uint8, the file's byte order
        return pack_nibbles(self.q)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K // 32, 16] uint8: a group's byte j holds its weight j in
    the low nibble and weight j + 16 in the high one (the Q4_0 blocks' order)."""
    q = q.view(q.shape[0], -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()


def unpack_q4(data: np.ndarray, qtype: GGMLQuantizationType) -> Q4Weight:
    """data: the tensor's raw bytes, [rows, bytes_per_row] uint8, as GGUFReader gives them."""
    if qtype == GGMLQuantizationType.Q4_K:
        return unpack_q4_k(data)
    rows = data.shape[0]
    header = 2 if qtype == GGMLQuantizationType.Q4_0 else 4  # bytes before the nibbles
    blocks = data.reshape(rows, -1, header + 16)  # [N, K / 32, header + 16]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K / 32]
    nibbles = blocks[..., header:]  # [N, K / 32, 16]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # [N, K / 32, 32]
    if qtype == GGMLQuantizationType.Q4_0:
        m, offset = np.zeros_like(d), 8.0
    else:
        m, offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), 0.0
    return Q4Weight(torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(d),
                    torch.from_numpy(m), torch.full((rows,), offset))


def unpack_q4_k(data: np.ndarray) -> Q4Weight:
    """A Q4_K tensor's raw bytes, [rows, bytes_per_row] uint8, as 4-bit groups of 32.

    A super-block: [d: f16][dmin: f16][scales: 12 x u8][qs: 128 x u8]; its 256 weights are
    4 chunks of 64, chunk c's byte j holding weight 64c + j (low nibble) and 64c + 32 + j
    (high nibble)."""
    rows = data.shape[0]
    blocks = data.reshape(-1, 144)  # [rows * K / 256, 144]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [B, 1]
    scale, minimum = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each
    nibbles = blocks[:, 16:].reshape(-1, 4, 32)  # [B, chunk, 32]
    q = np.stack([nibbles & 0xF, nibbles >> 4], axis=2)  # [B, chunk, 2, 32]
    group_d = d * scale.astype(np.float32)  # [B, 8], exact: f16 times a 6-bit integer
    group_m = -(dmin * minimum.astype(np.float32))  # [B, 8]
    return Q4Weight(torch.from_numpy(q.reshape(rows, -1).copy()),
                    torch.from_numpy(group_d.reshape(rows, -1)),
                    torch.from_numpy(group_m.reshape(rows, -1)),
                    torch.zeros(rows))
