"""What a KV transport declares: its name and capabilities, its sender's session and its
receiver's export. One module per transport defines `TRANSPORT`, an instance of a Transport
subclass; the registry (transports/__init__.py) lists it.

    name                the --transport value, the metric label, a lease's `transport`
    wire_kind           its TransportKind value on the wire (kv_transfer.proto); proto3 enums
                        carry any int32, so a transport for tests needs no proto change
    checksum_kind       what both ends compute over each layer: "xxh3" (host) or "sum32" (device)
    is_one_sided        the sender writes into the receiver's pool itself (then the pool is
                        mapped into the sender at connect, and LayerDone / Commit may take the
                        receiver's Unix socket); else the receiver writes the pushed bytes
    auto_rank           where "auto" tries it, lowest first; None: only when named

    unavailable_reason(pair)      why it cannot serve this (sender, receiver) pair, or None
    sender_refusal(device)        why this process cannot send over it at all, or None
    receiver_refusal(device)      why a decode worker on `device` cannot accept it, or None
    receiver_pool(layout, n)      the pool the decode worker's KV cache must live in, or None
    can_receive(pool)             whether a receiver with this pool can serve it
    export(pool)                  receiver, per handshake: what a sender needs to reach the pool
    export_to_proto(export, reply)  ... written into the HandshakeResponse
    attach(reply, layout)         sender: the receiver's pool mapped here, from the reply
    new_session(*args, pool, local)  sender: the SendSession of one transfer

Both sides and the negotiation reach a transport through the registry only; nothing else
branches on a transport's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine_core.kv_cache.layout import KVLayout
    from kv_transfer.control_client import LocalControlClient
    from kv_transfer.session import SendSession
    from protos.pdserve.internal import kv_transfer_pb2 as pb


def device_type(device: str) -> str:
    """"cuda" for "cuda:1", "cpu" for "cpu": torch.device(device).type, without torch."""
    return device.partition(":")[0]


@dataclass(frozen=True)
class Pair:
    """The facts about one (sender, receiver) pair that decide which transports can serve it,
    as each side sees them at the handshake."""

    sender_host: str  # negotiation.host_id() of each worker: equal means one kernel
    receiver_host: str
    sender_device: str  # where each worker's KV cache lives: "cpu" | "cuda:N"
    receiver_device: str

    def other_host_reason(self) -> str | None:
        """Why the two are not on one host (a same-host transport's first condition)."""
        if self.sender_host == self.receiver_host:
            return None
        return f"sender host {self.sender_host} != receiver host {self.receiver_host}"


@dataclass(frozen=True)
class ReceiverPool:
    """The decode worker's KV pool, as a transport's receiver half sees it."""

    kv_cache: torch.Tensor  # [num_layers, num_blocks, 2, block_size, heads, dim], contiguous
    shm_pool: object | None  # the SharedKVPool (transports/shm.py) kv_cache lives in, if any
    instance_id: str  # the receiver process (HandshakeResponse.receiver_instance)


class Transport:
    """Base of the transports; the defaults are those of a transport that needs nothing of
    the pool (the receiver writes what the sender pushes)."""

    name: str = ""
    wire_kind: int = 0
    checksum_kind: str = "xxh3"
    is_one_sided: bool = False
    auto_rank: int | None = None

    def unavailable_reason(self, pair: Pair) -> str | None:
        """Why this transport cannot work between the two workers of `pair`, or None if it
        can. Both ends ask, each with its own view of the facts."""
        return None

    def sender_refusal(self, device: str) -> str | None:
        """Why a sender whose KV cache is on `device` cannot use this transport whatever the
        receiver (checked before any network call), or None."""
        return None

    def receiver_refusal(self, device: str) -> str | None:
        """Why a decode worker whose KV cache is on `device` cannot accept this transport (its
        --transports naming it fails with this), or None."""
        return None

    def receiver_pool(self, layout: KVLayout, num_blocks: int) -> object | None:
        """The pool a decode worker's KV cache must live in to accept this transport (an
        object with a `tensor` and a `close()`: shm's SharedKVPool), or None: the worker
        allocates its own."""
        return None

    def can_receive(self, pool: ReceiverPool) -> bool:
        """Whether a receiver with this pool can serve the transport at all."""
        return True

    def export(self, pool: ReceiverPool) -> object | None:
        """Receiver side, at each handshake that chose this transport: what a sender needs to
        reach the pool (e.g. a fresh IPC handle), or None."""
        return None

    def export_to_proto(self, export: object | None, reply: pb.HandshakeResponse) -> None:
        """Write `export` into the handshake's reply (the servicer calls this)."""

    def attach(self, reply: pb.HandshakeResponse, layout: KVLayout) -> torch.Tensor | None:
        """Sender side, after the handshake: the receiver's pool mapped into this process
        ([num_layers, num_blocks, 2, block_size, heads, dim]) for a one-sided transport, else
        None. TransportRefusedError if it cannot be mapped here ("auto" then uses grpc)."""
        return None

    def new_session(self, *args, pool: torch.Tensor | None,
                    local: LocalControlClient | None) -> SendSession:
        """The session of one transfer; `args` are SendSession's positional arguments, `pool`
        what attach() returned, `local` the receiver's control socket (one-sided only)."""
        raise NotImplementedError
