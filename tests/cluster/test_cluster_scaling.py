"""Scaling a cluster at runtime, under load: a decode host added while 16 streams run is
discovered (through Redis) and serves within a bound; a decode host drained (SIGTERM: it
deregisters, stops taking requests and finishes its streams) and removed loses no request."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from gateway.disagg.worker_pools import REFRESH_S
from tests.cluster.cluster_checks import (
    Load,
    SteadyLoad,
    check_membership,
    check_quiescent,
    gateway_status,
    sample_value,
)
from tests.e2e.stack import check_continuation, resume_points
from tests.helpers import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PROMPTS = [[3 + (13 * i + j) % 500 for j in range(10)] for i in range(32)]
DISCOVERED_WITHIN_S = 2 * REFRESH_S + 1  # the gateway rereads Redis every REFRESH_S
USED_WITHIN_S = DISCOVERED_WITHIN_S + 5  # new requests keep coming: the next ones go there


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    # streams finish in place when drained (--grace: how long in-flight calls may run on)
    return cluster_factory(num_prefill=1, num_decode=1, decode_args=("--grace", "60"))


def claimed(worker) -> float:
    return sample_value(worker.metrics_url, "pdserve:kv_leases_ended_total", state="CLAIMED")


def check_outputs(cluster, offline, outcomes, max_tokens: int) -> None:
    assert [o.code for o in outcomes] == [None] * len(outcomes), [o.details for o in outcomes]
    offline.generate_many([o.prompt for o in outcomes], max_tokens, ignore_eos=True)
    points = resume_points(cluster.gateway_proc.output())
    for o in outcomes:
        assert len(o.token_ids) == max_tokens
        check_continuation(offline, o.prompt, o.token_ids, points.get(o.req_id, []))


def test_a_decode_host_added_under_load_is_discovered_and_used(cluster, tiny_offline):
    """Bounds from the worker's READY line (its model loaded, registered): DISCOVERED_WITHIN_S
    to be in the gateway's pool, USED_WITHIN_S to decode a request; 16 clients send streams
    all along."""
    load = SteadyLoad(cluster, PROMPTS, 120, 16, timeout_s=120)
    wait_until(lambda: len(load.outcomes) >= 16, 60, "a first round of streams")
    new = cluster.add_worker("decode")  # a new host, its worker registered in Redis
    t_ready = time.monotonic()
    wait_until(lambda: any(w["address"] == new.address and w["healthy"]
                           for w in gateway_status(cluster)["workers"]),
               DISCOVERED_WITHIN_S, f"the gateway to route to {new.name}")
    wait_until(lambda: claimed(new) > 0, USED_WITHIN_S - (time.monotonic() - t_ready),
               f"{new.name} to decode a request")
    check_outputs(cluster, tiny_offline, load.stop(), 120)
    check_membership(cluster)
    check_quiescent(cluster)


def test_a_drained_decode_host_loses_no_request(cluster, tiny_offline):
    """SIGTERM to decode-0 while it streams: it leaves Redis first (no new requests), finishes
    its streams within --grace, and exits 0; none of them needed another worker."""
    migrations = gateway_status(cluster)["migrations"]["decode"]
    load = Load(cluster, PROMPTS[:32], 150, 16, timeout_s=120)
    load.wait_tokens(64)
    address = cluster.workers["decode-0"].address
    in_flight = next(w["in_flight"] for w in gateway_status(cluster)["workers"]
                     if w["address"] == address)
    assert in_flight > 0
    proc = cluster.workers["decode-0"].proc
    client = redis.Redis(host=cluster.redis.ip, port=6379)
    try:
        proc.signal(signal.SIGTERM)
        # it leaves Redis (and so the gateway's pool) while its streams still run
        wait_until(lambda: not client.exists("pdserve:worker:decode:decode-0"), 5,
                   "decode-0 to deregister")
        assert proc.poll() is None
    finally:
        client.close()
    assert cluster.drain("decode-0") == 0
    check_outputs(cluster, tiny_offline, load.results(120), 150)
    assert gateway_status(cluster)["migrations"]["decode"] == migrations
    assert "Traceback" not in proc.output(), proc.output()[-3000:]
    check_membership(cluster)  # decode-0 is gone from the gateway's pools
    check_quiescent(cluster)
    again = Load(cluster, PROMPTS[:8], 16, 8, timeout_s=60).results(90)
    check_outputs(cluster, tiny_offline, again, 16)
