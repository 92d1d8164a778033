"""The paged KV cache's memory layout: the contract between the model, the kernels and the
transfer layer.

One tensor holds the whole cache of a worker:

    kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
                   |           |       |       |
                   |           |       |       +-- token slot inside the block
                   |           |       +---------- 0 = key, 1 = value
                   |           +------------------ physical block id (the block pool's id)
                   +------------------------------ decoder layer

    kv_cache[layer]          -> [num_blocks, 2, block_size, num_kv_heads, head_dim]
    kv_cache[layer][b]       -> one block of one layer: K and V, contiguous
                                (2 * block_size * num_kv_heads * head_dim elements)

A token at position p of a sequence with block table T lives in block T[p // block_size] at
slot p % block_size; its flat slot id is `T[p // block_size] * block_size + p % block_size`.

Why this order: the unit of transfer is "one block of one layer", and the prefill worker ships
a layer as soon as it is computed, so (layer, block) must be the outer two dimensions and the
bytes of one (layer, block) pair must be contiguous. K and V of a block travel together.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

from kernels import huge_pages

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVLayout:
    """Everything two workers must agree on before one writes into the other's KV blocks."""

    model: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        """Elements of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return self.block_numel * self.torch_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers."""
        return self.num_layers * self.block_nbytes // self.block_size

    def fingerprint(self) -> str:
        """A short stable hash of the layout, compared at handshake and published in discovery."""
        text = ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def mismatch(self, other: KVLayout) -> list[str]:
        """Names and values of the fields that differ, for a clear handshake error."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The zeroed cache; on CPU on 2 MiB pages where the OS allows (kernels/huge_pages.py)."""
        return huge_pages.zeros(self.cache_shape(num_blocks), self.torch_dtype, device)


def copy_kv_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """kv_cache[:, dst] = kv_cache[:, src] for each (src, dst) pair: every source is read
    before any destination is written (a block freed by one copy may be the next one's dst)."""
    dev = kv_cache.device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=dev)  # [num_copies]
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dev)
    # [num_layers, num_copies, 2, block_size, num_kv_heads, head_dim]
    kv_cache.index_copy_(1, dst, kv_cache.index_select(1, src))
