"""Protobuf <-> Python for the few types both ends of the handoff share."""

from __future__ import annotations

from engine_core.kv_cache.layout import KVLayout
from protos.pdserve.internal import kv_transfer_pb2 as pb

# The handoff's protocol version: what a transfer's bytes, checksums and control messages
# mean. A change that a peer of the previous version would misread bumps it (the checksum's
# change from CRC-32 to XXH3 and a device sum was one, before this field existed: a mixed pair
# then failed every transfer's verification, DATA_LOSS). Both ends send theirs in the handshake
# and refuse another, naming both, so a pool upgraded apart from the other fails at connect
# with that message instead. A peer that sends none (0) predates the field and speaks 1.
PROTOCOL_VERSION = 1


def protocol_mismatch(sender: int, receiver: int) -> list[str]:
    """The handshake's complaint (LayoutMismatchError's form) when the two versions differ,
    each 0 read as 1; [] when they agree."""
    sender, receiver = sender or 1, receiver or 1
    if sender == receiver:
        return []
    return [f"kv protocol version: {sender} != {receiver} (run both pools at one pdserve "
            f"release)"]


# A LocalControlRequest or LocalControlReply datagram on the same-host control socket, at most
# (receiver/control_server.py, control_client.py); a Commit of 1,000 layers is ~5 KB.
MAX_CONTROL_MESSAGE_BYTES = 1 << 16


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                       num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim)


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    """The layout a peer announced; ValueError if it is not a valid layout at all."""
    return KVLayout(model=msg.model, dtype=msg.dtype, block_size=msg.block_size,
                    num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
                    head_dim=msg.head_dim)


def to_ms(seconds: float) -> int:
    """A remaining time as the protos carry it: whole milliseconds, never negative."""
    return max(0, int(seconds * 1000))


def commit_to_proto(num_bytes_verified: int, verify_seconds: float) -> pb.CommitResponse:
    """A verified commit's reply (the gRPC service's and the same-host socket's)."""
    return pb.CommitResponse(num_bytes_verified=num_bytes_verified,
                             verify_us=int(verify_seconds * 1e6))
