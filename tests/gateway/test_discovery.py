"""Static discovery, and the disaggregated backend following discovery's answers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.disagg.backend import DisaggregatedBackend
from gateway.disagg.discovery import StaticDiscovery, WorkerAddress


class ChangingDiscovery:
    def __init__(self, workers: list[WorkerAddress]) -> None:
        self.now = workers
        self.is_closed = False

    async def workers(self) -> list[WorkerAddress]:
        return list(self.now)

    async def close(self) -> None:
        self.is_closed = True


def test_static_discovery_validates_addresses():
    d = StaticDiscovery(["127.0.0.1:1"], ["h:2", "h:3"])
    got = asyncio.run(d.workers())
    assert [(w.role, w.address) for w in got] == [
        ("prefill", "127.0.0.1:1"), ("decode", "h:2"), ("decode", "h:3")]
    with pytest.raises(ValueError, match="need at least one"):
        StaticDiscovery([], ["h:2"])
    with pytest.raises(ValueError, match="host:port"):
        StaticDiscovery(["h"], ["h:2"])
    with pytest.raises(ValueError, match="role"):
        WorkerAddress("router", "h:1")


def test_backend_follows_joins_and_leaves():
    async def scenario() -> None:
        disc = ChangingDiscovery([WorkerAddress("prefill", "127.0.0.1:1"),
                                  WorkerAddress("decode", "127.0.0.1:2")])
        backend = DisaggregatedBackend(disc, tokenizer=None)
        await backend.pools.discover()
        first_decode = backend.decode[0]
        assert [w.address for w in backend.prefill] == ["127.0.0.1:1"]
        disc.now = disc.now + [WorkerAddress("decode", "127.0.0.1:3")]
        await backend.pools.discover()
        assert [w.address for w in backend.decode] == ["127.0.0.1:2", "127.0.0.1:3"]
        assert backend.decode[0] is first_decode  # kept, not reconnected
        disc.now = [w for w in disc.now if w.address != "127.0.0.1:2"]
        await backend.pools.discover()
        assert [w.address for w in backend.decode] == ["127.0.0.1:3"]
        await backend.close()
        assert disc.is_closed

    asyncio.run(scenario())
