"""Fixtures for the KV handoff tests: a real decode-side receiver on a loopback grpc.aio server
(port 0) with its same-host control socket, random KV caches (fresh random bytes each run, seed printed), random block ids.

    rig = make_rig("shm", layout)     # receiver + lease table + server; torn down after the test
    lease = rig.open(num_blocks=5)    # random, non-contiguous destination blocks
    src_kv, src_ids = rig.source(5)   # a random sender cache and random source blocks
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from kv_helpers import NUM_DST_BLOCKS, Rig, random_cache

from engine_core.kv_cache.layout import KVLayout
from kv_transfer import (
    KVReceiver,
    KVTransferServicer,
    Lease,
    LeaseTable,
    LocalControlServer,
    SharedKVPool,
)
from tests.kv_transfer.loopback import LoopbackServer


@pytest.fixture
def seed() -> int:
    value = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {value}")  # shown by pytest when a test fails
    return value


@pytest.fixture
def make_rig(seed: int):
    rigs: list[Rig] = []

    def make(kind: str, layout: KVLayout, servicer_cls=KVTransferServicer,
             local_control_cls=LocalControlServer, **receiver_kwargs) -> Rig:
        """local_control_cls: the same-host control socket offered to shm / cuda_ipc senders,
        as the decode worker serves it (None: none, their control stays on gRPC)."""
        gen = torch.Generator().manual_seed(seed + len(rigs))
        pool = SharedKVPool.create(layout, NUM_DST_BLOCKS) if kind == "shm" else None
        kv = pool.tensor if pool else layout.allocate(NUM_DST_BLOCKS)
        kv.copy_(random_cache(layout, NUM_DST_BLOCKS, gen))  # stale bytes, never zeros
        released: list[tuple[Lease, str]] = []
        table = LeaseTable(lambda lease, reason: released.append((lease, reason)))
        receiver_kwargs.setdefault("reap_interval_s", 0.02)
        receiver = KVReceiver(layout, kv, table, shm_pool=pool, **receiver_kwargs)
        local = local_control_cls(receiver).start() if local_control_cls else None
        server = LoopbackServer(servicer_cls(receiver, local.path if local else "")).start()
        rig = Rig(kind, layout, kv, table, receiver, server, random.Random(seed), gen, pool,
                  released, local)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.server.stop(grace_s=None)
        if rig.local is not None:
            rig.local.close()
        rig.receiver.close()
        rig.table.check_integrity()
        for lease, _ in rig.released:  # on_release ran at most once per lease
            assert sum(r.lease_id == lease.lease_id for r, _ in rig.released) == 1
        if rig.pool is not None:
            rig.pool.close()
