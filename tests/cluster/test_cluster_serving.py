"""The cluster serves across hosts: Redis, the gateway, a prefill worker and two decode workers
each on a host of its own, found through Redis. Greedy output equals the offline engine's;
`auto` picks grpc between hosts; between a prefill and a decode host that share a machine id
but not /dev/shm (two pods of one node) it picks shm by the ids, cannot map the pool and falls
back to grpc, which the prefill worker logs and exports in pdserve:kv_transport_info."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_checks import Load, check_quiescent, sample_value, scrape

pytestmark = pytest.mark.cluster

PROMPTS = [[3 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(8)]  # 5..26 tokens
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    # decode-1 shares prefill-0's machine id: pods of one node, each with its own /dev/shm
    return cluster_factory(num_prefill=1, num_decode=2, same_node=(("prefill-0", "decode-1"),))


def test_greedy_output_across_hosts_equals_offline(cluster, tiny_offline):
    load = Load(cluster, PROMPTS, MAX_TOKENS, concurrency=8, timeout_s=60)
    results = load.results(90)
    assert [r.code for r in results] == [None] * len(PROMPTS), [r.details for r in results]
    for r in results:
        expected = tiny_offline.generate(r.prompt, MAX_TOKENS, ignore_eos=True)
        assert r.token_ids == expected.outputs[0].token_ids, r.prompt
    claimed = {w.name: sample_value(w.metrics_url, "pdserve:kv_leases_ended_total",
                                    state="CLAIMED") for w in cluster.live("decode")}
    assert sum(claimed.values()) == len(PROMPTS) and all(claimed.values()), claimed
    check_quiescent(cluster)


def test_auto_picks_grpc_across_hosts_and_falls_back_from_shm_on_one_node(cluster):
    """Both pairs carried KV in the test above (every decode worker claimed some)."""
    prefill = cluster.workers["prefill-0"]
    pairs = {s.labels["decode"]: s.labels for s in scrape(prefill.metrics_url)
             if s.name == "pdserve:kv_transport_info" and s.value == 1}
    other, same_node = cluster.workers["decode-0"], cluster.workers["decode-1"]
    assert set(pairs) == {other.address, same_node.address}, pairs
    assert other.host.machine_id != prefill.host.machine_id == same_node.host.machine_id
    assert {k: pairs[other.address][k] for k in ("transport", "control", "fallback_from")} == \
        {"transport": "grpc", "control": "grpc", "fallback_from": ""}
    assert {k: pairs[same_node.address][k] for k in ("transport", "control",
                                                     "fallback_from")} == \
        {"transport": "grpc", "control": "grpc", "fallback_from": "shm"}
    assert all(p["prefill"] == "prefill-0" for p in pairs.values())
    log = prefill.proc.log.read_text()
    assert (f"kv transfer to {same_node.address}: shm cannot map the receiver's pool here"
            in log), log[-3000:]
    assert f"kv transfer to {other.address}: shm cannot" not in log
    assert (f"kv transfer to {other.address} uses grpc, control over grpc (requested auto"
            in log), log[-3000:]
