"""Shared helpers of the KV handoff tests (imported by conftest.py and the test files)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer import KVReceiver, Lease, LeaseTable, LocalControlServer, SharedKVPool
from tests.kv_transfer.loopback import LoopbackServer

LAYOUTS = [
    KVLayout("tiny", "float32", block_size=16, num_layers=3, num_kv_heads=2, head_dim=32),
    KVLayout("tiny", "bfloat16", block_size=8, num_layers=4, num_kv_heads=3, head_dim=64),
    KVLayout("odd", "float16", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8),
]
NUM_DST_BLOCKS = 48  # receiver pool
NUM_SRC_BLOCKS = 40  # sender cache


def random_cache(layout: KVLayout, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes (NaN payloads included) viewed as a cache: bit-exactness is the test."""
    shape = layout.cache_shape(num_blocks)
    nbytes = layout.num_layers * num_blocks * layout.block_nbytes
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(layout.torch_dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@dataclass
class Rig:
    """One decode-side receiver on loopback, with everything a test looks at."""

    kind: str
    layout: KVLayout
    kv: torch.Tensor  # the receiver's cache [num_layers, NUM_DST_BLOCKS, 2, bs, heads, dim]
    table: LeaseTable
    receiver: KVReceiver
    server: LoopbackServer
    rng: random.Random
    gen: torch.Generator
    pool: SharedKVPool | None = None
    released: list[tuple[Lease, str]] = field(default_factory=list)
    local: LocalControlServer | None = None  # the same-host control socket, if served

    @property
    def target(self) -> str:
        return self.server.target

    def open(self, num_blocks: int, ttl_s: float = 10.0) -> Lease:
        held = {b for lease in self.table.leases() for b in lease.block_ids}
        free = [b for b in range(NUM_DST_BLOCKS) if b not in held]
        return self.table.open("req", self.rng.sample(free, num_blocks), ttl_s)

    def source(self, num_blocks: int) -> tuple[torch.Tensor, list[int]]:
        kv = random_cache(self.layout, NUM_SRC_BLOCKS, self.gen)
        return kv, self.rng.sample(range(NUM_SRC_BLOCKS), num_blocks)

    def releases_of(self, lease_id: str) -> list[tuple[Lease, str]]:
        return [(lease, reason) for lease, reason in self.released if lease.lease_id == lease_id]
