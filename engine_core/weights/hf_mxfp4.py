"""A Hugging Face checkpoint's MXFP4 experts (GPT-OSS as OpenAI released it) as the C kernels'
4-bit table weights, read straight from the file: each expert's decode rows multiply the
checkpoint's own values, and with prefill_weights "quantized" no dense copy of the experts is
made at all (model_loader.py), as with a GGUF's MXFP4 experts.

    `*.mlp.experts.gate_up_proj_blocks`  [E, 2 width, K / 32, 16] uint8: two FP4 codes a
                                         byte, the even element in the low nibble; rows
                                         alternate gate and up
    `*.mlp.experts.gate_up_proj_scales`  [E, 2 width, K / 32] uint8: E8M0 exponents
    `*.mlp.experts.down_proj_blocks`     [E, hidden, width / 32, 16], `_scales` likewise

An FP4 code is the index into gguf's MXFP4 table (its values doubled, as integers), and an
exponent e gives d = 2^(e - 127) / 2 (gguf's `MXFP4.e8m0_to_fp32_half`): w = table[code] * d,
the same float32 value transformers' dequantizer computes. Unpacked a tensor at a time, on
access, the last one kept (its experts are asked for one after another).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf.quants import MXFP4
from safetensors import safe_open

from engine_core.weights.gguf_q8 import NLWeight

_KINDS = ("gate_up_proj", "down_proj")


def _stem_kind(name: str) -> tuple[str, str] | None:
    """("model.layers.L.mlp.experts", kind) of a `*_blocks` tensor name, else None."""
    stem, _, last = name.rpartition(".")
    kind = last.removesuffix("_blocks")
    return (stem, kind) if last.endswith("_blocks") and kind in _KINDS and \
        stem.endswith("mlp.experts") else None


def unpack(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [E, rows, K] uint8 0..15, d [E, rows, K / 32] float32) of one blocks/scales
    pair."""
    b = blocks.numpy()
    codes = np.empty((*b.shape[:-1], 32), dtype=np.uint8)
    codes[..., 0::2], codes[..., 1::2] = b & 0x0F, b >> 4
    d = MXFP4.e8m0_to_fp32_half(scales.numpy().reshape(-1, 1).copy())
    return (torch.from_numpy(codes.reshape(*b.shape[:-2], -1)),
            torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(scales.shape)))


class MXFP4Experts(Mapping):
    """HF name of one expert's matrix (`model.layers.L.mlp.experts.E.gate_proj.weight`, up_proj,
    down_proj) -> its NLWeight (kind 9), for quantize_for_decode's q8 weights."""

    def __init__(self, files: dict[str, Path], shapes: dict[tuple[str, str], list[int]]):
        self._files = files  # tensor name -> the shard holding it
        self._shapes = shapes  # (stem, kind) -> its blocks' shape [E, rows, K / 32, 16]
        self._names = {}
        for (stem, kind), shape in shapes.items():
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            for e in range(shape[0]):
                for i, part in enumerate(parts):
                    self._names[f"{stem}.{e}.{part}.weight"] = (stem, kind, e, i, len(parts))
        self._unpack = functools.lru_cache(maxsize=1)(self._read)
        self._table = torch.tensor(MXFP4.kvalues, dtype=torch.int8)

    def _read(self, stem: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        pair = []
        for suffix in ("_blocks", "_scales"):
            name = f"{stem}.{kind}{suffix}"
            with safe_open(str(self._files[name]), framework="pt") as st:
                pair.append(st.get_tensor(name))
        return unpack(*pair)

    def __getitem__(self, name: str) -> NLWeight:
        stem, kind, e, i, n = self._names[name]
        codes, d = self._unpack(stem, kind)
        return NLWeight(codes[e, i::n].contiguous(), d[e, i::n].contiguous(), self._table)

    def __contains__(self, name: object) -> bool:  # (Mapping's would unpack the tensor)
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def num_weights(self) -> int:
        """The experts' weights, what a dense copy of them would hold."""
        return sum(e * rows * groups * 32 for e, rows, groups, _ in self._shapes.values())


def mxfp4_experts(folder: Path) -> MXFP4Experts | None:
    """The folder's MXFP4 experts (None: it holds none), from the shards' headers: nothing is
    read or unpacked yet. A blocks tensor without its scales is refused."""
    files, shapes = {}, {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                files[name] = f
                found = _stem_kind(name)
                if found is not None:
                    shapes[found] = st.get_slice(name).get_shape()
    missing = [f"{stem}.{kind}_scales" for stem, kind in shapes
               if f"{stem}.{kind}_scales" not in files]
    if missing:
        raise ValueError(f"MXFP4 experts without both blocks and scales: {missing}")
    return MXFP4Experts(files, shapes) if shapes else None
