"""Where the gateway finds its workers: an interface with a static implementation.

The disaggregated backend asks `workers()` on every status refresh (once a second), so an
implementation that changes its answer makes workers join and leave without a restart. The
static list is what `pdserve up` and `pdserve gateway --prefill ... --decode ...` use;
`pdserve gateway --redis-url` uses the Redis registry (gateway/disagg/redis_discovery.py), where workers
register themselves with heartbeats and also publish which prompt blocks they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerAddress:
    """A worker to route to. Past role and address: what a registry (gateway/disagg/redis_discovery.py)
    knows about it; a static list leaves the defaults."""

    role: str  # "prefill" | "decode"
    address: str  # host:port of its gRPC server
    worker_id: str = ""  # stable across restarts (the pod's name); "" when unknown
    model: str = ""
    layout_fingerprint: str = ""  # KVLayout.fingerprint(); "" when unknown
    epoch: int = 0  # the worker's restart count: a new epoch at one address is a new process
    num_blocks: int = 0  # its KV pool, in blocks (0: unknown)
    max_num_seqs: int = 0
    registration_ttl_s: float = 0.0  # how long its entry outlives a heartbeat (0: unknown)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{self.role} worker address must be host:port, got "
                             f"{self.address!r}")


class Discovery(Protocol):
    async def workers(self) -> list[WorkerAddress]:
        """The workers to route to now."""
        ...

    async def close(self) -> None: ...


class StaticDiscovery:
    """A fixed list of workers (the embedded default)."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode worker address")
        self._workers = [WorkerAddress("prefill", a) for a in prefill] + [
            WorkerAddress("decode", a) for a in decode]

    async def workers(self) -> list[WorkerAddress]:
        return list(self._workers)

    async def close(self) -> None:
        return None
