"""GGUF tensors whose weights are a small integer times a scale, plus a constant, per group
of 32 or 16 along K: the C kernels' q8 family (kernels/csrc/cpu_kernels.h).

    type    group  w                            q            from the block header
    Q8_0    32     d * q                        -127..127    d
    Q5_0    32     d * q                        -16..15      d
    Q5_1    32     d * q + m                    0..31        d, m
    Q5_K    32     (d * sc) * q - dmin * mn     0..31        d, dmin, 6-bit (sc, mn) pairs
    Q6_K    16     (d * sc) * q                 -32..31      d, int8 sc per 16
    Q3_K    16     (d * (sc - 32)) * q          -4..3        d, 6-bit sc per 16
    Q2_K    16     (d * sc) * q - dmin * mn     0..3         d, dmin, 4-bit (sc, mn) per 16
    IQ4_NL  32     d * q                        -127..113    d (q: a 16-value table's entry)
    IQ4_XS  32     (d * (sc - 32)) * q          -127..113    d, 6-bit sc per 32
    IQ3_XXS 32     (d * (0.5 + sc) * 0.5) * q   +-4..62      d, 4-bit sc per 32
    IQ3_S   32     (d * (1 + 2 sc)) * q         +-1..15      d, 4-bit sc per 32
    IQ2_XXS 32     (d * (0.5 + sc) * 0.25) * q  +-8..43      d, 4-bit sc per 32
    IQ2_XS  16     (d * (0.5 + sc) * 0.25) * q  +-8..43      d, 4-bit sc per 16
    IQ2_S   16     (d * (0.5 + sc) * 0.25) * q  +-8..43      d, 4-bit sc per 16
    IQ1_S   32     (d * (2 sc + 1) / 8) * q     +-1, 7, 9    d, 3-bit sc per 32
    MXFP4   32     (2^e / 2) * q                -12..12      e, an 8-bit exponent (E8M0)

The IQ types' q is a grid entry times a sign (gguf's grid tables and sign bits, applied by its
dequantizer): their scales multiply a signed grid value once, so the product is one rounding,
as here. IQ1_S adds +-1/8 to each grid value in {-1, 0, 1} before its scale; eight times
that is an integer, and a scale divided by 8 is exact, so it joins the family too. MXFP4
(GPT-OSS's experts) holds FP4 values, which doubled are the integers above, and a power of two
per 32 that gguf's `MXFP4.e8m0_to_fp32_half` halves.

Each is kept as q (int8), d and c per group (c = the constant, absent where it is 0), so
w = q * d + c with the product rounded first: the same float32 operations as gguf's own
dequantizers, bit for bit. The scales come from the block headers (for Q5_K through gguf's own
`Q4_K.get_scale_min`; Q3_K's 6-bit scales are packed across 12 bytes, unpacked as gguf's
`Q3_K` does); the integers are recovered from gguf's own `gguf.quants.dequantize`, as
round((w - c) / d), and checked to give w back exactly, so no bit layout is re-derived here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import IQ4_NL, MXFP4, Q4_K, dequantize

from engine_core.weights.gguf_q4 import Q4Weight, pack_nibbles

Q = GGMLQuantizationType
Q8_TYPES = (Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS,
            Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.MXFP4)
GROUP_SIZE = 32


@dataclass
class Q8Weight:
    """A [out_features, in_features] weight as int8 q and float32 d (and c) per group: 32 along
    K, or 16 ("half": d.shape[1] == K / 16)."""

    q: torch.Tensor  # [N, K] int8
    d: torch.Tensor  # [N, K / 32] or [N, K / 16] float32
    c: torch.Tensor | None  # like d, or None: no constant

    @property
    def is_half(self) -> bool:
        return self.d.shape[1] * 16 == self.q.shape[1]

    @property
    def kind(self) -> int:
        """The C kernels' weight kind (cpu_kernels.h): 8, 5 (+ c), 6 (half), 7 (half + c)."""
        return {(False, False): 8, (False, True): 5, (True, False): 6,
                (True, True): 7}[(self.is_half, self.c is not None)]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        group = 16 if self.is_half else GROUP_SIZE
        w = self.q.float() * self.d.repeat_interleave(group, dim=1)
        return w if self.c is None else w + self.c.repeat_interleave(group, dim=1)

    def permute_rows(self, index: torch.Tensor) -> Q8Weight:
        return Q8Weight(self.q[index], self.d[index], None if self.c is None else self.c[index])

    def halved(self) -> Q8Weight:
        """The same weights with d (and c) per 16: every group's scale twice."""
        if self.is_half:
            return self
        return Q8Weight(self.q, self.d.repeat_interleave(2, dim=1),
                        None if self.c is None else self.c.repeat_interleave(2, dim=1))

    @staticmethod
    def from_q4(w: Q4Weight) -> Q8Weight:
        """A 4-bit weight, (q - offset) * d + m, in the q8 form (for a fused projection whose
        other parts are q8): q - offset times d, plus m where the type has one."""
        q = (w.q.to(torch.int16) - w.offset.to(torch.int16)[:, None]).to(torch.int8)
        return Q8Weight(q, w.d.float(), None if bool((w.m == 0).all()) else w.m.float())

    @staticmethod
    def cat(parts: list[Q8Weight]) -> Q8Weight:
        """Stack weights along the output dimension (fused q/k/v or gate/up projections): in
        the most general form any part needs (per 16 if one is, with c if one has it)."""
        if any(p.is_half for p in parts):
            parts = [p.halved() for p in parts]
        c = None
        if any(p.c is not None for p in parts):
            c = torch.cat([torch.zeros_like(p.d) if p.c is None else p.c for p in parts])
        return Q8Weight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), c)


# the types whose weights are a 4-bit index into a 16-entry table times d per 32: kept as
# the indices (NLWeight, the C kernels' KIND_NL: half the bytes of int8), the table gguf's own
NL_TABLES = {Q.IQ4_NL: IQ4_NL.kvalues, Q.IQ4_XS: IQ4_NL.kvalues, Q.MXFP4: MXFP4.kvalues}


@dataclass
class NLWeight:
    """A [out_features, in_features] weight as 4-bit indices into `table` and d per 32 along
    K: w = table[q] * d (the C kernels' kind 9). Its q8 form (`to_q8`) is table[q] as int8."""

    q: torch.Tensor  # [N, K] uint8, 0..15
    d: torch.Tensor  # [N, K / 32] float32
    table: torch.Tensor  # [16] int8

    kind = 9

    def to_q8(self) -> Q8Weight:
        return Q8Weight(self.table[self.q.long()], self.d, None)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.to_q8().dequantize()

    def permute_rows(self, index: torch.Tensor) -> NLWeight:
        return NLWeight(self.q[index], self.d[index], self.table)

    def packed_nibbles(self) -> torch.Tensor:  # [N, K // 32, 16] uint8, as a q4 group's
        return pack_nibbles(self.q)


def cat_blocks(parts: list[Q8Weight | NLWeight]) -> Q8Weight | NLWeight:
    """Stack weights along the output dimension (a fused projection): one NLWeight where every
    part is one over the same table, else the q8 form of them all."""
    if all(isinstance(p, NLWeight) and torch.equal(p.table, parts[0].table) for p in parts):
        return NLWeight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                        parts[0].table)
    return Q8Weight.cat([p.to_q8() if isinstance(p, NLWeight) else p for p in parts])


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:  # [B, 1] float32
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _scales(blocks: np.ndarray, qtype: GGMLQuantizationType):
    """d and c (or None) per group of each block, float32 as gguf computes them: [B, groups]."""
    if qtype in (Q.Q8_0, Q.Q5_0, Q.IQ4_NL):
        return _f16(blocks, 0), None
    if qtype == Q.IQ4_XS:  # [d][scales_h: u16, 2 bits per 32][scales_l: 4 bits per 32][qs]
        high = blocks[:, 2:4].copy().view(np.uint16)  # [B, 1]
        high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [B, 8]
        low = blocks[:, 4:8]  # [B, 4]: groups 2i and 2i + 1 in the low and high nibbles
        low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(-1, 8)
        sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
        return _f16(blocks, 0) * sc.astype(np.float32), None
    if qtype == Q.Q5_1:
        return _f16(blocks, 0), _f16(blocks, 2)
    if qtype == Q.Q5_K:  # [d][dmin][12 bytes of 6-bit (sc, mn)]...
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each
        return _f16(blocks, 0) * sc.astype(np.float32), -(_f16(blocks, 2) * mn.astype(np.float32))
    if qtype == Q.Q6_K:  # [ql: 128][qh: 64][sc: 16 x i8][d]
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [B, 16]
        return _f16(blocks, 208) * sc, None
    if qtype == Q.Q3_K:  # [hmask: 32][qs: 64][12 bytes of 6-bit sc][d]
        low = blocks[:, 96:104]  # sc 0..7 in the low nibbles, 8..15 in the high ones
        low = np.concatenate([low & 0x0F, low >> 4], axis=1)  # [B, 16]
        high = blocks[:, 104:108]  # sc i's top 2 bits: byte i % 4, bits 2 * (i // 4)
        high = np.concatenate([(high >> s) & 3 for s in (0, 2, 4, 6)], axis=1)
        sc = (low | (high << 4)).astype(np.int8) - np.int8(32)
        return _f16(blocks, 108) * sc.astype(np.float32), None
    if qtype == Q.Q2_K:  # [16 bytes of 4-bit (sc, mn)][qs: 64][d][dmin]
        sc, mn = blocks[:, :16] & 0x0F, blocks[:, :16] >> 4
        return (_f16(blocks, 80) * sc.astype(np.float32),
                -(_f16(blocks, 82) * mn.astype(np.float32)))
    if qtype in _IQ_SCALES:
        return _iq_scales(blocks, qtype), None
    if qtype == Q.MXFP4:  # [e: u8][qs: 16 bytes of nibbles]
        return MXFP4.e8m0_to_fp32_half(blocks[:, :1].copy()), None
    raise ValueError(f"GGUF type {qtype.name} is not in the q8 family ({Q8_TYPES})")


# IQ type -> (where its sub-block scales are: "u32" the top 4 bits of each group's second or
# only 32-bit word from this byte, "nibbles" 4 bits each from this byte, "iq1" bits 12..14 of
# 16-bit words from this byte; that offset), as gguf's dequantizers read them
_IQ_SCALES = {Q.IQ2_XXS: ("u32", 2), Q.IQ3_XXS: ("u32", 66), Q.IQ2_XS: ("nibbles", 66),
              Q.IQ2_S: ("nibbles", 74), Q.IQ3_S: ("nibbles", 106), Q.IQ1_S: ("iq1", 34)}


def _iq_scales(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """d per group of an IQ type's blocks, float32 as gguf computes it: [B, groups]."""
    where, at = _IQ_SCALES[qtype]
    d, n = _f16(blocks, 0), blocks.shape[0]
    if where == "u32":  # IQ2_XXS: a (grid, signs + scale) word pair per 32; IQ3_XXS: a word
        words = blocks[:, at:at + 32 if qtype == Q.IQ3_XXS else at + 64].copy().view(np.uint32)
        sc = (words.reshape(n, 8, -1)[..., -1] >> 28).astype(np.float32)
        return d * (np.float32(0.5) + sc) * np.float32(0.5 if qtype == Q.IQ3_XXS else 0.25)
    if where == "nibbles":
        raw = blocks[:, at:at + (4 if qtype == Q.IQ3_S else 8)]
        sc = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, -1).astype(np.float32)
        if qtype == Q.IQ3_S:
            return d * (np.float32(1) + np.float32(2) * sc)
        return d * (np.float32(0.5) + sc) * np.float32(0.25)
    qh = blocks[:, at:at + 16].copy().view(np.uint16)  # IQ1_S: [B, 8]
    dl = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    return dl * np.float32(0.125)  # q = 8 * (grid value +- 1/8)


# blocks whose integers are recovered at once: each step's float32 temporaries stay near
# 64 MB, whatever the tensor (an output head of 128k rows is hundreds of millions of weights)
UNPACK_CHUNK_ELEMENTS = 1 << 24


def _integers(w: np.ndarray, d: np.ndarray, c: np.ndarray | None,
              qtype: GGMLQuantizationType) -> np.ndarray:
    """The int8 q of weights w [B, groups, group] = q * d (+ c), checked to give w back."""
    shifted = w if c is None else w - c[..., None]
    safe_d = np.where(d == 0, np.float32(1), d)[..., None]
    q = np.where(d[..., None] == 0, 0, np.rint(shifted / safe_d)).astype(np.int8)
    back = q.astype(np.float32) * d[..., None]
    if c is not None:
        back += c[..., None]
    if not np.array_equal(back, w):
        raise ValueError(f"{qtype.name} tensor: its integers do not give gguf's weights back")
    return q


def unpack_q8(data: np.ndarray, qtype: GGMLQuantizationType,
              dense: np.ndarray | None = None) -> Q8Weight | NLWeight:
    """data: the tensor's raw bytes, [rows, bytes_per_row] uint8, as GGUFReader gives them;
    dense: gguf's dequantization of them where the caller has it already (float32, any
    shape), else it is computed here, a chunk of blocks at a time. A type of NL_TABLES comes
    back as its table's indices (NLWeight), found from the integers (each the table entry it
    is; a table holding a value twice, MXFP4's 0, gives the first)."""
    rows = data.shape[0]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, type_size)  # [B, block bytes]
    d, c = _scales(blocks, qtype)  # [B, groups]
    num_blocks, groups = d.shape
    flat = None if dense is None else dense.reshape(num_blocks, block_size)
    q = np.empty((num_blocks, groups, block_size // groups), dtype=np.int8)
    step = max(1, UNPACK_CHUNK_ELEMENTS // block_size)
    for at in range(0, num_blocks, step):
        part = slice(at, at + step)
        w = dequantize(blocks[part], qtype) if flat is None else flat[part]
        q[part] = _integers(w.astype(np.float32, copy=False).reshape(q[part].shape), d[part],
                            None if c is None else c[part], qtype)
    per_row = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, -1)  # noqa: E731
    if qtype in NL_TABLES:
        table = np.array(NL_TABLES[qtype], dtype=np.int8)
        position = np.full(256, 16, dtype=np.uint8)  # integer + 128 -> its first index
        position[table[::-1].astype(np.int16) + 128] = np.arange(15, -1, -1, dtype=np.uint8)
        index = position[q.astype(np.int16) + 128]
        # a group whose d is 0 holds q 0, which a table may lack: any index will do there
        missing = (index == 16) & (d[..., None] != 0)
        if missing.any():
            raise ValueError(f"{qtype.name} tensor: an integer not in its table")
        index[index == 16] = 0
        return NLWeight(per_row(index), per_row(d), torch.from_numpy(table))
    return Q8Weight(per_row(q), per_row(d), None if c is None else per_row(c))

