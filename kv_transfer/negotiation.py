"""How a sender and a receiver agree on a transport: the transports' kinds on the wire, each
worker's host identity, and the rules that pick one. Below both sides of the handoff: the
receiver chooses at the handshake (KVReceiver.handshake), the sender runs the same rules on its
side of the facts and refuses a choice it would not have made (sender.connect).

    select_transport(requested, pair facts, allowed)
      requested named:  it, if it can serve the pair and the receiver enabled it; else
                        TransportRefusedError (a ValueError): never a silent fallback
      requested "auto": the first of the receiver's enabled transports that can serve the
                        pair, in the transports' auto_rank order (cuda_ipc, shm, grpc)

Whether a transport can serve a pair is its own rule (Transport.unavailable_reason, in its
module under transports/); this module knows no transport by name.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from collections.abc import Collection
from pathlib import Path

from kv_transfer import transports
from kv_transfer.errors import TransportRefusedError
from kv_transfer.transports.base import Pair
from protos.pdserve.internal import kv_transfer_pb2 as pb

AUTO = "auto"  # a request only: let the receiver pick


def host_id() -> str:
    """A stable id of this machine (and boot): equal ids mean the same kernel, so a same-host
    transport may work. The env var PDSERVE_HOST_ID overrides it (tests, odd deployments)."""
    return os.environ.get("PDSERVE_HOST_ID") or _machine_host_id()


@functools.cache
def _machine_host_id() -> str:
    parts = []
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id",
                 "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            continue
    if not parts:
        parts.append(socket.gethostname())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def kind_to_proto(kind: str) -> int:
    """A requested or chosen transport as its TransportKind; ValueError if unknown."""
    if kind == AUTO:
        return pb.TRANSPORT_KIND_AUTO
    try:
        return transports.get(kind).wire_kind
    except ValueError:
        raise ValueError(f"unknown transport {kind!r}; choose one of "
                         f"{', '.join((AUTO, *transports.names(include_tests=True)))}") from None


def kind_from_proto(value: int) -> str:
    """The transport (or "auto") a TransportKind names; ValueError if none."""
    if value == pb.TRANSPORT_KIND_AUTO:
        return AUTO
    for transport in transports.all_transports():
        if transport.wire_kind == value:
            return transport.name
    raise ValueError(f"unknown TransportKind {value}")


def select_transport(requested: str, sender_host: str, receiver_host: str,
                     sender_device: str, receiver_device: str, *,
                     allowed: Collection[str] | None = None) -> str:
    """The transport to use: `requested` if it can work (else TransportRefusedError), or for
    "auto" the best that can, among the receiver's `allowed` transports (default: all)."""
    known = transports.names(include_tests=True)
    if requested != AUTO and requested not in known:
        raise ValueError(f"unknown transport {requested!r}; choose one of "
                         f"{', '.join((AUTO, *known))}")
    allowed = known if allowed is None else allowed
    pair = Pair(sender_host, receiver_host, sender_device, receiver_device)
    if requested == AUTO:
        candidates = sorted((t for t in transports.all_transports(include_tests=False)
                             if t.auto_rank is not None), key=lambda t: t.auto_rank)
        reasons = {t.name: t.unavailable_reason(pair) for t in candidates}
        for transport in candidates:
            if transport.name in allowed and reasons[transport.name] is None:
                return transport.name
        raise TransportRefusedError(f"no enabled transport works (enabled: {sorted(allowed)}): "
                                    f"{reasons}")
    reason = transports.get(requested).unavailable_reason(pair)
    if reason is not None:
        raise TransportRefusedError(f"transport {requested} cannot work: {reason}")
    if requested not in allowed:
        raise TransportRefusedError(f"transport {requested} is not enabled on the receiver "
                                    f"(enabled: {sorted(allowed)})")
    return requested


def accepted_transports(flag: str, device: str) -> list[str]:
    """The transports a decode worker whose KV cache is on `device` accepts, from its
    --transports: "auto" is every transport that can receive there (those for tests
    excepted), in listing order; a named one that cannot is a ValueError saying why."""
    if flag.strip() == AUTO:
        return [t.name for t in transports.all_transports(include_tests=False)
                if t.receiver_refusal(device) is None]
    kinds = [k.strip() for k in flag.split(",") if k.strip()]
    for kind in kinds:
        reason = transports.get(kind).receiver_refusal(device)  # an unknown one: ValueError
        if reason is not None:
            raise ValueError(f"--transports {flag}: {reason}")
    return kinds
