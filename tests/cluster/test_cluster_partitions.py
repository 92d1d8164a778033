"""Partitions under load, on a cluster of Redis, a gateway, two prefill and two decode hosts.
Each fault runs while 16 streams are in flight and is healed; the links drop packets silently
(pdserve/cluster/netns.py), as a real partition does.

The invariants, for every fault:
- every request ends, completed with the greedy output of the offline engine (a stream that
  moved to another decode worker continues the offline continuation of what it had), within
  the bound stated for the fault, measured from the request's start. Redundant pools make
  completion the expected end: no fault here leaves the stack without a working path;
- readiness (/health/ready) answers 200 in every sample, throughout the fault and the heal,
  since a path through the pools exists all the time;
- after healing, within 30 s no lease and no KV block is held on any host and the gateway
  has no stream left, membership converges to exactly the live workers, all healthy, and
  the next requests succeed (the healed worker serves again where the fault took it out).

The bounds follow from the design: a peer that stops answering is found by gRPC keepalive
within DETECT_S (kv_transfer/transports/grpc.py), a stalled transfer's lease expires after the
gateway's --lease-ttl, and the retry runs the request again elsewhere."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from kv_transfer.grpc_options import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S
from pdserve.cluster.stack import ClusterStack
from tests.cluster.cluster_checks import (
    Load,
    Outcome,
    Readiness,
    check_membership,
    check_quiescent,
    gateway_status,
    sample_value,
)
from tests.e2e.stack import check_continuation, resume_points
from tests.helpers import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

DETECT_S = KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S  # a silent peer's calls fail within this
SLACK_S = 10.0  # the re-run of a moved request and the load of 2 shared cores
CONCURRENCY = 16
STREAMS = [[3 + (7 * i + j) % 500 for j in range(8)] for i in range(32)]
STREAM_TOKENS = 200
LONG_PROMPTS = [[3 + (11 * i + j) % 500 for j in range(800)] for i in range(40)]  # 800 KB KV
LONG_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(cluster_factory) -> ClusterStack:
    return cluster_factory(num_prefill=2, num_decode=2)


def under_fault(cluster: ClusterStack, cut: Callable[[], None], heal: Callable[[], None],
                cut_s: float, prompts: list[list[int]], max_tokens: int,
                before_cut: Callable[[], None] = lambda: None
                ) -> tuple[list[Outcome], Readiness, float]:
    """Start the load, cut once it streams, heal after cut_s, wait for every request: the
    outcomes, the readiness samples and when the heal came (seconds after the cut)."""
    with Readiness(cluster) as readiness:
        load = Load(cluster, prompts, max_tokens, CONCURRENCY, timeout_s=120)
        load.wait_tokens(CONCURRENCY * 2)
        before_cut()
        t_cut = time.monotonic()
        cut()
        try:
            time.sleep(cut_s)
        finally:
            heal()
        healed_after = time.monotonic() - t_cut
        outcomes = load.results(180)
    return outcomes, readiness, healed_after


def check_invariants(cluster: ClusterStack, offline, outcomes: list[Outcome],
                     readiness: Readiness, bound_s: float, max_tokens: int) -> None:
    failed = [(o.code, o.details) for o in outcomes if o.code is not None]
    assert not failed, failed
    slow = sorted(round(o.seconds, 1) for o in outcomes if o.seconds > bound_s)
    assert not slow, f"requests ended after the bound of {bound_s} s: {slow}"
    points = resume_points(cluster.gateway_proc.output())
    offline.generate_many([o.prompt for o in outcomes], max_tokens, ignore_eos=True)
    for o in outcomes:
        assert len(o.token_ids) == max_tokens, (o.req_id, len(o.token_ids))
        check_continuation(offline, o.prompt, o.token_ids, points.get(o.req_id, []))
    assert readiness.not_ready() == [], readiness.not_ready()
    check_quiescent(cluster)
    check_membership(cluster)


def next_requests_succeed(cluster: ClusterStack, offline, n: int = 8) -> None:
    outcomes = Load(cluster, STREAMS[:n], 16, n, timeout_s=60).results(90)
    expected = offline.generate_many(STREAMS[:n], 16, ignore_eos=True)
    for o, e in zip(outcomes, expected, strict=True):
        assert o.code is None, o.details
        assert o.token_ids == e.outputs[0].token_ids


def claimed(worker) -> float:
    return sample_value(worker.metrics_url, "pdserve:kv_leases_ended_total", state="CLAIMED")


def in_flight_on(cluster: ClusterStack, name: str) -> int:
    address = cluster.workers[name].address
    return next(w["in_flight"] for w in gateway_status(cluster)["workers"]
                if w["address"] == address)


def test_a_decode_host_cut_mid_stream(cluster, tiny_offline):
    """Bound: DETECT_S + SLACK_S. The streams on the cut host move to the other decode
    worker once keepalive gives the connection up, before the link comes back; the cut
    host's worker aborts them when its own keepalive loses the gateway."""
    host = cluster.workers["decode-0"].host
    seen: list[int] = []
    outcomes, readiness, healed_after = under_fault(
        cluster, lambda: cluster.net.set_link(host, False),
        lambda: cluster.net.set_link(host, True), DETECT_S + 3, STREAMS, STREAM_TOKENS,
        before_cut=lambda: seen.append(in_flight_on(cluster, "decode-0")))
    assert seen[0] > 0, "no stream on the host when it was cut"
    check_invariants(cluster, tiny_offline, outcomes, readiness, DETECT_S + SLACK_S,
                     STREAM_TOKENS)
    assert gateway_status(cluster)["migrations"]["decode"] >= seen[0]
    before = claimed(cluster.workers["decode-0"])
    next_requests_succeed(cluster, tiny_offline)
    assert claimed(cluster.workers["decode-0"]) > before  # it serves again


def test_a_prefill_host_cut_mid_transfer(cluster, tiny_offline):
    """Both prefill links at 20 Mbit/s: an 800-token prompt's KV (800 KB here) takes 0.3 s
    alone, and more beside the others. The cut takes the first prefill host seen with a
    transfer in flight (its pdserve:kv_transfers_active). A stalled transfer's lease ends
    EXPIRED after the lease ttl, or ABORTED when the decode worker's keepalive drops the push
    stream first (5-10 s after the cut, by the pings' phase): either frees its blocks, which
    check_quiescent sees. Bound: DETECT_S (the gateway gives the silent prefill worker up) +
    the lease ttl + SLACK_S."""
    prefill = cluster.live("prefill")
    sending: list = []

    def find_sending() -> None:
        sending.append(wait_until(lambda: next((w for w in prefill if sample_value(
            w.metrics_url, "pdserve:kv_transfers_active")), None), 60,
            "a prefill worker with a transfer in flight", interval_s=0.01))

    for w in prefill:
        cluster.net.shape(w.host, 20e6)
    try:
        outcomes, readiness, _ = under_fault(
            cluster, lambda: cluster.net.set_link(sending[0].host, False),
            lambda: cluster.net.set_link(sending[0].host, True), 12.0, LONG_PROMPTS,
            LONG_TOKENS, before_cut=find_sending)
    finally:
        for w in prefill:
            cluster.net.shape(w.host, None)
    bound = DETECT_S + cluster.spec.lease_ttl_s + SLACK_S
    check_invariants(cluster, tiny_offline, outcomes, readiness, bound, LONG_TOKENS)
    assert gateway_status(cluster)["migrations"]["prefill"] > 0
    next_requests_succeed(cluster, tiny_offline)


def test_the_gateway_cut_from_redis(cluster, tiny_offline):
    """Longer than the registration ttl: the gateway keeps routing over the workers it last
    saw, logs the outage once, and picks Redis up again. Bound: SLACK_S (nothing waits on
    Redis)."""
    members = {(w["role"], w["address"]) for w in gateway_status(cluster)["workers"]}
    during: list[set] = []

    def cut() -> None:
        cluster.net.partition(cluster.gateway, cluster.redis)

    def heal() -> None:
        during.append({(w["role"], w["address"]) for w in gateway_status(cluster)["workers"]})
        cluster.net.heal(cluster.gateway, cluster.redis)

    outcomes, readiness, _ = under_fault(cluster, cut, heal,
                                         3 * cluster.spec.registration_ttl_s, STREAMS,
                                         STREAM_TOKENS)
    check_invariants(cluster, tiny_offline, outcomes, readiness, SLACK_S, STREAM_TOKENS)
    assert during == [members]
    log = cluster.gateway_proc.output()
    assert re.search(r"discovery: keeping the last known workers: redis at \S+ is "
                     r"unavailable", log), log[-3000:]
    wait_until(lambda: "discovery: redis answers again" in cluster.gateway_proc.output(), 10,
               "the gateway to log Redis's return")
    next_requests_succeed(cluster, tiny_offline)


def test_redis_cut_from_everyone(cluster, tiny_offline):
    """Longer than the registration ttl: every entry expires in Redis, as nobody can
    heartbeat. Serving goes on; after the heal the workers write their entries back, and the
    gateway keeps them meanwhile (gateway/disagg/redis_discovery.py), so readiness never drops.
    Bound: SLACK_S."""
    import redis

    outcomes, readiness, _ = under_fault(
        cluster, lambda: cluster.net.set_link(cluster.redis, False),
        lambda: cluster.net.set_link(cluster.redis, True),
        3 * cluster.spec.registration_ttl_s, STREAMS, STREAM_TOKENS)
    check_invariants(cluster, tiny_offline, outcomes, readiness, SLACK_S, STREAM_TOKENS)
    client = redis.Redis(host=cluster.redis.ip, port=6379, decode_responses=True)
    try:
        wait_until(lambda: sorted(k.rsplit(":", 1)[1] for k in client.keys(
            "pdserve:worker:*")) == sorted(w.name for w in cluster.live()), 10,
            "every worker registered again")
    finally:
        client.close()
    next_requests_succeed(cluster, tiny_offline)


def test_a_decode_host_isolated_from_the_prefill_pool_only(cluster, tiny_offline):
    """The gateway still reaches decode-0 (its Status and Reserve succeed), its prefill
    workers do not: each failed handoff marks the pair (gateway/disagg/pair_health.py) and routing
    puts a decode worker without a working pair last. Bound: SLACK_S + the prefill worker's
    handshake timeout for each of the two pairs. After the heal, decode-0 is tried again once
    the marks expire (HOLD_S) and serves."""
    from gateway.disagg.pair_health import HOLD_S
    from kv_transfer.send_options import SenderOptions

    d0 = cluster.workers["decode-0"].host
    prefill = [w.host for w in cluster.live("prefill")]
    healthy: list[bool] = []

    def cut() -> None:
        for host in prefill:
            cluster.net.partition(d0, host)

    def heal() -> None:
        healthy.append(all(w["healthy"] for w in gateway_status(cluster)["workers"]))
        for host in prefill:
            cluster.net.heal(d0, host)

    outcomes, readiness, _ = under_fault(cluster, cut, heal, 8.0, STREAMS, STREAM_TOKENS)
    assert healthy == [True]  # the gateway saw every worker healthy during the partition
    bound = SLACK_S + 2 * SenderOptions().rpc_timeout_s
    check_invariants(cluster, tiny_offline, outcomes, readiness, bound, STREAM_TOKENS)
    before = claimed(cluster.workers["decode-0"])
    time.sleep(HOLD_S)
    next_requests_succeed(cluster, tiny_offline)
    assert claimed(cluster.workers["decode-0"]) > before  # it serves again


def test_every_process_stops_cleanly_after_the_faults(cluster):
    codes = cluster.exit_codes()
    assert codes == dict.fromkeys(codes, 0), codes
    for proc in [cluster.gateway_proc, *(w.proc for w in cluster.workers.values())]:
        assert "Traceback" not in proc.output(), proc.output()[-4000:]
