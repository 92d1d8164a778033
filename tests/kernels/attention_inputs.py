"""Random paged-attention inputs shared by tests/kernels and benchmarks/bench_kernels.py.

The cache is a *layer view* of a 3-layer cache tensor (never the whole tensor), block tables
are a random permutation of the block ids, and table entries past a sequence's last block hold
`tail_value` (default an out-of-range id, so a kernel reading them would fail loudly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tolerances of a kernel's output against the fp32 torch reference, by dtype. bf16 allows about
# one ulp at |x| < 4 (2**-6) plus the reference's own output rounding; fp32 differs only in
# summation order.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 1e-3},
}


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """assert_close with the dtype's TOLERANCES; dtypes must match."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **TOLERANCES[expected.dtype])


@dataclass
class DecodeInputs:
    """Arguments of `paged_decode_attention`, in order."""

    query: torch.Tensor  # [num_seqs, num_q_heads, head_dim]
    kv_layer: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    scale: float

    def args(self) -> tuple:
        return self.query, self.kv_layer, self.block_tables, self.context_lens, self.scale

    def to(self, device: torch.device | str) -> DecodeInputs:
        return DecodeInputs(
            self.query.to(device),
            self.kv_layer.to(device),
            self.block_tables.to(device),
            self.context_lens.to(device),
            self.scale,
        )


@dataclass
class PrefillInputs:
    """Arguments of `paged_prefill_attention`, in order."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    kv_layer: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    scale: float

    def args(self) -> tuple:
        return (
            self.query,
            self.kv_layer,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
        )

    def metadata(self):
        """The engine's AttentionMetadata of a step of these prefill chunks alone (no decode
        rows): what the C row kernel reads, one row per token."""
        from engine_core.model.attention import AttentionMetadata

        return AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
            decode_context_lens=torch.zeros(0, dtype=torch.int32),
            prefill_block_tables=self.block_tables, prefill_query_start_loc=self.query_start_loc,
            prefill_seq_lens=self.seq_lens)

    def to(self, device: torch.device | str) -> PrefillInputs:
        return PrefillInputs(
            self.query.to(device),
            self.kv_layer.to(device),
            self.block_tables.to(device),
            self.query_start_loc.to(device),
            self.seq_lens.to(device),
            self.scale,
        )


def random_kv_layer(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> torch.Tensor:
    """Layer 1 of a random [3, num_blocks, 2, block_size, H, D] cache (a view, not the whole)."""
    shape = (3, num_blocks, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=generator).to(dtype)
    return cache[1]  # [num_blocks, 2, block_size, H, D]


def random_block_tables(
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    generator: torch.Generator,
    tail_value: int | None = None,
) -> torch.Tensor:
    """[num_seqs, max_blocks + 1] int32 tables of distinct random block ids.

    Needs num_blocks ≥ the total number of blocks the sequences use.
    """
    needed = [(n + block_size - 1) // block_size for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, only {num_blocks} in the cache")
    tail = num_blocks + 1000 if tail_value is None else tail_value
    tables = torch.full((len(seq_lens), max(needed, default=0) + 1), tail, dtype=torch.int32)
    block_ids = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    used = 0
    for s, n in enumerate(needed):
        tables[s, :n] = block_ids[used : used + n]
        used += n
    return tables


def make_decode_inputs(
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> DecodeInputs:
    """Random decode inputs; the cache has `spare_blocks` blocks no sequence uses."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in context_lens) + spare_blocks
    kv_layer = random_kv_layer(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator)
    shape = (len(context_lens), num_q_heads, head_dim)
    return DecodeInputs(
        query=torch.randn(shape, generator=generator).to(dtype),
        kv_layer=kv_layer,
        block_tables=random_block_tables(context_lens, block_size, num_blocks, generator),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def make_prefill_inputs(
    query_lens: list[int],
    prefix_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PrefillInputs:
    """Random prefill inputs: sequence s has prefix_lens[s] cached and query_lens[s] new tokens."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens, strict=True)]
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + spare_blocks
    kv_layer = random_kv_layer(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    shape = (sum(query_lens), num_q_heads, head_dim)
    return PrefillInputs(
        query=torch.randn(shape, generator=generator).to(dtype),
        kv_layer=kv_layer,
        block_tables=random_block_tables(seq_lens, block_size, num_blocks, generator),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
    )
