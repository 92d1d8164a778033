"""The errors of the KV handoff, one class per thing a caller does differently.

    KVTransferError
    ├── LayoutMismatchError   handshake refused: the two workers' KV layouts differ
    ├── TransportRefusedError handshake refused: the requested transport cannot work here
    ├── TransferError         one send session failed (aborted, expired, verification failed)
    ├── VerificationError     receiver: the committed bytes do not match the sender's checksums
    └── LeaseError            receiver: a verb does not apply to the lease in its current state
        ├── UnknownLeaseError   no such lease (never opened, or forgotten long ago)
        └── LeaseEndedError     the lease has ended (claimed, failed, aborted, expired)

The receiver's two edges, the gRPC servicer (receiver/servicer.py) and the same-host socket
(receiver/control_server.py), answer them with the status names of `status_name`; nothing
deeper knows about gRPC.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every error raised by kv_transfer."""


class LayoutMismatchError(KVTransferError):
    """The sender's and the receiver's KV layouts differ; `mismatches` names each field as
    "field: sender_value != receiver_value"."""

    PREFIX = "KV layout mismatch (sender != receiver): "

    def __init__(self, mismatches: list[str]) -> None:
        self.mismatches = list(mismatches)
        super().__init__(self.PREFIX + "; ".join(self.mismatches))

    @classmethod
    def from_message(cls, message: str) -> LayoutMismatchError | None:
        """Rebuild the error from its message (as carried in a gRPC status), else None."""
        if not message.startswith(cls.PREFIX):
            return None
        return cls(message[len(cls.PREFIX) :].split("; "))


class TransportRefusedError(KVTransferError, ValueError):
    """The requested transport cannot work between these two workers (e.g. shm across hosts,
    cuda_ipc without CUDA). Never answered by a silent fallback."""


class TransferError(KVTransferError):
    """A send session failed; `code` is the gRPC status name when the receiver refused."""

    def __init__(self, message: str, code: str = "") -> None:
        self.code = code
        super().__init__(message)


class VerificationError(KVTransferError):
    """The destination blocks do not match the sender's checksums (or layers are missing)."""


class LeaseError(KVTransferError):
    """A lease verb does not apply to the lease in its current state."""

    def __init__(self, lease_id: str, message: str) -> None:
        self.lease_id = lease_id
        super().__init__(f"lease {lease_id}: {message}")


class UnknownLeaseError(LeaseError):
    """No lease with this id (never opened, or ended long enough ago to be forgotten)."""


class LeaseEndedError(LeaseError):
    """The lease has ended; `state` is its terminal state's name and `reason` why."""

    def __init__(self, lease_id: str, state: str, reason: str) -> None:
        self.state = state
        self.reason = reason
        super().__init__(lease_id, f"{state}" + (f": {reason}" if reason else ""))


_STATUS_NAMES = (  # first match wins: subclasses before their bases
    (UnknownLeaseError, "NOT_FOUND"),
    (LeaseEndedError, "ABORTED"),
    (VerificationError, "DATA_LOSS"),
    ((LayoutMismatchError, TransportRefusedError, LeaseError), "FAILED_PRECONDITION"),
    (ValueError, "INVALID_ARGUMENT"),  # a malformed request
)


def status_name(error: BaseException) -> str | None:
    """The gRPC status name a receiver answers `error` with; None for an unexpected error
    (a bug: the edge logs it and answers UNKNOWN or INTERNAL)."""
    for types, name in _STATUS_NAMES:
        if isinstance(error, types):
            return name
    return None
