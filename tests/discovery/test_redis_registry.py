"""Worker registration and gateway discovery through a private real Redis: the fields and
TTL, expiry without heartbeats, deregistration, restart epochs, a worker killed with SIGKILL,
prefix publication, password and TLS."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest
import redis

from gateway.disagg.backend import DisaggregatedBackend
from gateway.disagg.discovery import WorkerAddress
from gateway.disagg.redis_discovery import RedisDiscovery
from service_infra.redis_registry import RedisConfig, RedisUnavailable, block_member
from service_infra.worker_registration import WorkerInfo, WorkerRegistration
from tests.discovery.conftest import PASSWORD
from tests.helpers import ROOT

INFO = WorkerInfo("prefill", "SmolLM2-135M-Instruct", "0123456789abcdef", 16, 100, 8)


def registration(url: str, worker_id: str | None = "prefill-a", ttl_s: float = 10.0,
                 info: WorkerInfo = INFO, **kw) -> WorkerRegistration:
    return WorkerRegistration(RedisConfig(url, **kw), info, "127.0.0.1", worker_id, ttl_s)


async def listed(discovery: RedisDiscovery) -> list[tuple[str, str, int]]:
    return [(w.role, w.address, w.epoch) for w in await discovery.workers()]


async def wait_listed(discovery: RedisDiscovery, expected, timeout_s: float) -> float:
    """Seconds until discovery lists exactly `expected`."""
    start = time.monotonic()
    while await listed(discovery) != expected:
        assert time.monotonic() - start < timeout_s, await listed(discovery)
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def crash(reg: WorkerRegistration) -> None:
    """Stop heartbeating without deregistering (what a dead process does)."""
    for task in reg._tasks:
        task.cancel()


def test_config_validates_flags_and_redacts_the_password(tmp_path):
    cfg = RedisConfig("redis://user:hunter2@h:6379/0")
    assert cfg.redacted_url == "redis://user:***@h:6379/0"
    assert RedisConfig("redis://:hunter2@h:1").redacted_url == "redis://:***@h:1"
    assert RedisConfig("redis://h:1/2").redacted_url == "redis://h:1/2"
    assert cfg.worker_key("decode", "d-1") == "pdserve:worker:decode:d-1"
    assert cfg.epoch_key("d-1") == "pdserve:epoch:d-1"
    assert cfg.prefix_key("d-1") == "pdserve:prefix:d-1"
    with pytest.raises(ValueError, match="redis://HOST:PORT") as e:
        RedisConfig("http://:hunter2@h:1")
    assert "hunter2" not in str(e.value)
    with pytest.raises(ValueError, match="only for a rediss://"):
        RedisConfig("redis://h:1", tls_ca=str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        RedisConfig("rediss://h:1", tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="go together"):
        RedisConfig("rediss://h:1", tls_cert=__file__)
    with pytest.raises(ValueError, match="namespace"):
        RedisConfig("redis://h:1", namespace="a:*")


def test_registration_fields_ttl_and_deregistration(redis_server):
    async def scenario() -> None:
        reg = registration(redis_server.url)
        await reg.start(5555)
        r = redis.Redis(port=redis_server.port, decode_responses=True)
        key = "pdserve:worker:prefill:prefill-a"
        fields = r.hgetall(key)
        assert float(fields.pop("started_at")) == pytest.approx(time.time(), abs=5)
        assert fields == {
            "address": "127.0.0.1:5555", "role": "prefill", "worker_id": "prefill-a",
            "model": "SmolLM2-135M-Instruct", "layout_fingerprint": "0123456789abcdef",
            "block_size": "16", "num_blocks": "100", "max_num_seqs": "8", "epoch": "1",
            "registration_ttl_s": "10.0", "num_offload_blocks": "0"}
        assert 0 < r.pttl(key) <= 10_000
        assert r.get("pdserve:epoch:prefill-a") == "1"
        assert r.ttl("pdserve:epoch:prefill-a") > 24 * 3600  # outlives restarts
        discovery = await RedisDiscovery.connect(RedisConfig(redis_server.url))
        assert await discovery.workers() == [WorkerAddress(
            "prefill", "127.0.0.1:5555", worker_id="prefill-a", model="SmolLM2-135M-Instruct",
            layout_fingerprint="0123456789abcdef", epoch=1, num_blocks=100, max_num_seqs=8,
            registration_ttl_s=10.0)]
        # another namespace is another deployment: not seen
        other = await RedisDiscovery.connect(RedisConfig(redis_server.url, namespace="other"))
        assert await other.workers() == []
        await reg.stop()
        assert not r.exists(key)
        assert await discovery.workers() == []
        assert r.get("pdserve:epoch:prefill-a") == "1"  # kept for the next start
        await discovery.close()
        await other.close()
        r.close()

    asyncio.run(scenario())


def test_heartbeats_keep_the_entry_and_it_expires_when_they_stop(redis_server):
    async def scenario() -> None:
        reg = registration(redis_server.url, ttl_s=1.0)
        await reg.start(5555)
        discovery = await RedisDiscovery.connect(RedisConfig(redis_server.url))
        for _ in range(5):  # 2.5 ttls: only heartbeats keep it
            await asyncio.sleep(0.5)
            assert await listed(discovery) == [("prefill", "127.0.0.1:5555", 1)]
        crash(reg)
        gone_after = await wait_listed(discovery, [], timeout_s=3.0)
        assert gone_after <= 1.0 + 0.5, gone_after  # within one ttl of the last heartbeat
        await discovery.close()

    asyncio.run(scenario())


def test_restart_bumps_the_epoch_and_the_gateway_reconnects(redis_server):
    async def scenario() -> None:
        discovery = await RedisDiscovery.connect(RedisConfig(redis_server.url))
        backend = DisaggregatedBackend(discovery, tokenizer=None)
        first = registration(redis_server.url)
        await first.start(5555)
        await backend.pools.discover()
        (old,) = backend.prefill
        assert (old.worker_id, old.epoch) == ("prefill-a", 1)
        crash(first)  # the process died; it comes back at the same address before expiry
        second = registration(redis_server.url)
        await second.start(5555)
        assert second.epoch == 2
        await backend.pools.discover()
        (new,) = backend.prefill
        assert new is not old and new.epoch == 2
        assert old.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        await backend.pools.discover()
        assert backend.prefill == [new]  # the same epoch again: kept
        await second.stop()  # a graceful restart counts as well
        third = registration(redis_server.url)
        await third.start(5555)
        assert third.epoch == 3
        await third.stop()
        await backend.close()

    asyncio.run(scenario())


WORKER = """
import asyncio, sys
from service_infra.redis_registry import RedisConfig
from service_infra.worker_registration import WorkerInfo, WorkerRegistration

async def main():
    info = WorkerInfo("decode", "m", "f", 16, 100, 8)
    reg = WorkerRegistration(RedisConfig(sys.argv[1]), info, "127.0.0.1", None, float(sys.argv[2]))
    await reg.start(int(sys.argv[3]))
    print("READY", reg.worker_id, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_killed_worker_expires_and_the_gateway_drops_it(redis_server):
    ttl = 1.5
    proc = subprocess.Popen([sys.executable, "-c", WORKER, redis_server.url, str(ttl), "6001"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["READY", "decode-127.0.0.1-6001"]

        async def scenario() -> None:
            discovery = await RedisDiscovery.connect(RedisConfig(redis_server.url))
            backend = DisaggregatedBackend(discovery, tokenizer=None)
            await asyncio.sleep(2 * ttl)  # heartbeats from the other process keep it listed
            await backend.pools.discover()
            assert [w.address for w in backend.decode] == ["127.0.0.1:6001"]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            gone_after = await wait_listed(discovery, [], timeout_s=ttl + 2)
            assert gone_after <= ttl + 0.5, gone_after
            await backend.pools.discover()
            assert backend.decode == []
            await backend.close()

        asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait()


def test_workers_are_kept_for_their_ttl_after_a_redis_outage(redis_server):
    """Redis unreachable (SIGSTOP) for longer than the ttl: every entry expires in Redis, yet
    discovery keeps the workers it knew for one ttl after Redis answers again (they write
    their entries back within a third of it), then drops those that did not come back."""

    async def scenario() -> None:
        ttl = 1.0
        reg = registration(redis_server.url, ttl_s=ttl)
        await reg.start(5555)
        crash(reg)  # no heartbeat: the entry will not come back
        discovery = await RedisDiscovery.connect(RedisConfig(redis_server.url))
        assert await listed(discovery) == [("prefill", "127.0.0.1:5555", 1)]
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()  # the outage: the last known workers meanwhile
            assert await listed(discovery) == [("prefill", "127.0.0.1:5555", 1)]
            await asyncio.sleep(max(0.0, ttl + 0.2 - (time.monotonic() - t0)))
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        r = redis.Redis(port=redis_server.port, decode_responses=True)
        assert not r.exists("pdserve:worker:prefill:prefill-a")  # expired during the outage
        r.close()
        assert await listed(discovery) == [("prefill", "127.0.0.1:5555", 1)]  # the grace
        assert await wait_listed(discovery, [], timeout_s=ttl + 1) >= ttl - 0.3
        await discovery.close()
        await reg.stop()

    asyncio.run(scenario())


def test_prefix_publication_is_bounded_and_expires(redis_server):
    async def scenario() -> None:
        small = WorkerInfo("prefill", "m", "f", 16, 4, 8)  # a pool of 4 blocks
        reg = WorkerRegistration(RedisConfig(redis_server.url), small, "127.0.0.1", "p",
                                 prefix_ttl_s=60)
        await reg.start(5555)
        r = redis.Redis(port=redis_server.port, decode_responses=True)
        discovery = await RedisDiscovery.connect(RedisConfig(redis_server.url))
        reg.publish_prefix([1, 2, 3])
        await asyncio.sleep(0.2)
        members = dict(r.zrange("pdserve:prefix:p", 0, -1, withscores=True))
        assert sorted(members) == [block_member(h) for h in (1, 2, 3)]
        assert all(abs(s - (time.time() + 60)) < 5 for s in members.values())
        assert 0 < r.pttl("pdserve:prefix:p") <= 60_000
        assert await discovery.prefix_overlap(["p", "nobody"], [1, 2, 3, 4]) == {
            "p": 3, "nobody": 0}
        assert await discovery.prefix_overlap(["p"], [9, 2, 3]) == {"p": 0}  # leading only
        reg.publish_prefix([4, 5, 6])  # 6 > 4 blocks: the oldest go
        await asyncio.sleep(0.2)
        assert sorted(r.zrange("pdserve:prefix:p", 0, -1)) == [
            block_member(h) for h in (3, 4, 5, 6)]
        reg.prefix_ttl_s = 0.3
        reg.publish_prefix([7])
        await asyncio.sleep(0.5)  # 7 has expired: not counted, and trimmed by the next write
        assert await discovery.prefix_overlap(["p"], [7]) == {"p": 0}
        reg.publish_prefix([8])
        await asyncio.sleep(0.2)
        assert block_member(7) not in r.zrange("pdserve:prefix:p", 0, -1)
        await reg.stop()
        assert not r.exists("pdserve:prefix:p")  # deregistration drops it too
        await discovery.close()
        r.close()

    asyncio.run(scenario())


def test_password_authentication(redis_password_server):
    url = redis_password_server.url

    async def scenario() -> None:
        reg = registration(url, password=PASSWORD)
        await reg.start(5555)
        discovery = await RedisDiscovery.connect(RedisConfig(url, password=PASSWORD))
        assert await listed(discovery) == [("prefill", "127.0.0.1:5555", 1)]
        await reg.stop()
        await discovery.close()
        for config in (RedisConfig(url), RedisConfig(url, password="wrong"),
                       RedisConfig(url.replace("//", "//:wrong@"))):
            with pytest.raises(RedisUnavailable) as e:
                await RedisDiscovery.connect(config)
            assert f"redis at {config.redacted_url} refused the credentials" in str(e.value)
            assert "wrong" not in str(e.value) and PASSWORD not in str(e.value)
        with pytest.raises(RedisUnavailable, match="refused the credentials"):
            await registration(url, password="wrong").start(5555)

    asyncio.run(scenario())


def test_tls_with_client_certificates(redis_tls_server):
    tls = redis_tls_server.tls
    url = redis_tls_server.url
    assert url.startswith("rediss://")

    async def scenario() -> None:
        kw = dict(tls_ca=str(tls.ca), tls_cert=str(tls.cert), tls_key=str(tls.key))
        reg = registration(url, **kw)
        await reg.start(5555)
        discovery = await RedisDiscovery.connect(RedisConfig(url, **kw))
        assert await listed(discovery) == [("prefill", "127.0.0.1:5555", 1)]
        await reg.stop()
        await discovery.close()
        refused = (RedisConfig(url, tls_ca=str(tls.ca)),  # no client certificate
                   RedisConfig(url, tls_ca=str(tls.ca), tls_cert=str(tls.rogue_cert),
                               tls_key=str(tls.rogue_key)),  # signed by another CA
                   RedisConfig(url, tls_cert=str(tls.cert), tls_key=str(tls.key)))  # no CA
        for config in refused:
            with pytest.raises(RedisUnavailable, match=f"redis at {url} is unavailable"):
                await RedisDiscovery.connect(config)

    asyncio.run(scenario())
