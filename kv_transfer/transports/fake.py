"""The fake transport, for tests: sender and receiver in one process, the receiver's pool handed
over through a process-local dict instead of a shared-memory file or a CUDA IPC handle.

    receiver, at the handshake:  export(pool) -> _POOLS[instance id] = the KV pool (weakly)
    sender, after it:            attach(reply) -> _POOLS[reply.receiver_instance], the same
                                 tensor; each layer is copied in and reported as over shm
                                 (one_sided.py), the checksum on the host (xxh3)

It runs the whole handoff (handshake, Begin, LayerDone, Commit and its verification, Abort)
with neither /dev/shm nor a GPU. Registered for tests only: no CLI offers it, "auto" never
picks it, and a receiver serves it only when its allowed transports name it.
"""

from __future__ import annotations

import weakref

import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer.errors import TransportRefusedError
from kv_transfer.transports.base import Pair, ReceiverPool
from kv_transfer.transports.one_sided import OneSidedTransport
from protos.pdserve.internal import kv_transfer_pb2 as pb

# receiver instance id -> its KV pool [num_layers, num_blocks, 2, block_size, heads, dim],
# for as long as the receiver keeps the pool
_POOLS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


class FakeTransport(OneSidedTransport):
    name = "fake"
    wire_kind = 100  # no TransportKind names it; proto3 enums carry any value

    def unavailable_reason(self, pair: Pair) -> str | None:
        return pair.other_host_reason()

    def export(self, pool: ReceiverPool) -> None:
        _POOLS[pool.instance_id] = pool.kv_cache

    def attach(self, reply: pb.HandshakeResponse, layout: KVLayout) -> torch.Tensor:
        pool = _POOLS.get(reply.receiver_instance)
        if pool is None:
            raise TransportRefusedError(f"fake: receiver {reply.receiver_instance} is not in "
                                        f"this process")
        return pool


TRANSPORT = FakeTransport()
