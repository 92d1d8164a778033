"""What a send session is given and what it reports: its options, its states, its stats
(the session itself: session.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: ~the best gRPC Python loopback throughput here
MAX_CHUNK_BYTES = 4 << 20


class SendState(enum.Enum):
    SENDING = "SENDING"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"


@dataclass(frozen=True)
class SenderOptions:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # grpc: payload bytes per PushBlocks message
    max_queued_layers: int = 4  # layer snapshots waiting per session (bounds memory)
    rpc_timeout_s: float = 5.0  # deadline of each unary control RPC
    commit_timeout_s: float = 30.0  # default wait in commit(), including verification
    # shm / cuda_ipc: LayerDone and Commit over the receiver's Unix socket when it is reachable
    # (control_client.py); False keeps them on gRPC
    local_control: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], "
                             f"got {self.chunk_bytes}")
        if self.max_queued_layers < 1:
            raise ValueError(f"max_queued_layers must be >= 1, got {self.max_queued_layers}")
        if self.rpc_timeout_s <= 0 or self.commit_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")


@dataclass(frozen=True)
class TransferStats:
    """What one committed transfer cost. Times are seconds since Connection.begin()."""

    transport: str
    num_layers: int
    num_blocks: int  # blocks per layer
    num_bytes: int  # payload shipped over all layers, bytes
    num_chunks: int  # grpc: PushBlocks chunks sent (0 for one-sided transports)
    seconds: float  # begin() -> commit acknowledged
    commit_seconds: float  # commit requested -> acknowledged: the part never overlapped
    verify_seconds: float  # receiver's checksum verification (part of commit_seconds)
    commit_rpc_seconds: float  # the Commit RPC, sent -> answered (part of commit_seconds)
    layer_queued_s: tuple[float, ...]  # per layer: send_layer() returned
    layer_shipped_s: tuple[float, ...]  # per layer: all its bytes handed to the transport
    num_snapshot_buffers: int = 0  # host buffers the layers were gathered into (reused)

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def link_seconds(self) -> float:
        """From the first layer queued to the commit verified: the wire time of num_bytes when
        the link is the bottleneck, and about the rest of the forward plus the tail when the
        compute is (a layer-wise push then keeps up with the layers). Either way, this time
        minus the forward it overlaps is what the transfer adds to the first token
        (gateway/disagg/prefill_policy.py exposed_transfer_s). Not the bytes handed to the transport:
        HTTP/2 buffers a window's worth of them at once, whatever the link."""
        return self.seconds - (self.layer_queued_s[0] if self.layer_queued_s else 0.0)
