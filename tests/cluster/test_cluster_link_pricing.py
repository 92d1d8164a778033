"""`--prefill-policy auto` prices a remote prefill's KV transfer at the link's measured speed
(gateway/disagg/prefill_policy.py): on a cluster of one prefill and one decode host, with three
streams decoding all along (what a local prefill stalls), an 800-token prompt goes to the
prefill pool while the link is fast, and to the decode worker once the prefill host's link is
shaped to 5 Mbit/s and a few transfers have measured it (its 0.8 MB of KV takes 1.3 s
there, against ~0.1 s of prefill here: the first token comes several times sooner locally)."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_checks import SteadyLoad, gateway_status, generate, status
from tests.helpers import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SLOW_LINK = 5e6  # bits/s


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    return cluster_factory(num_prefill=1, num_decode=1, gateway_args=(
        "--canary-idle-s", "0", "--prefill-policy", "auto", "--local-prefill-max-tokens",
        "4096"))


def placed(cluster, i: int, prompt_logprobs: int | None = None) -> tuple[str, str]:
    """Where the gateway prefilled a fresh 800-token prompt, and why."""
    o = generate(cluster.grpc_addr, [3 + (31 * i + j) % 500 for j in range(800)], 2, 60,
                 prompt_logprobs=prompt_logprobs)
    assert o.code is None, o.details
    return o.timing.prefill_where, o.timing.prefill_reason


def test_autos_decision_follows_the_link(cluster):
    # 300-token prompts: the decode worker prefills them in full chunks and so measures its
    # prefill speed as it is (a few tokens a step would read as a crawl)
    streams = SteadyLoad(cluster, [[3 + (7 * i + j) % 500 for j in range(300)] for i in range(3)],
                         600, 3, timeout_s=120)
    prefill = cluster.workers["prefill-0"]
    try:
        placed(cluster, 0)  # remote ("unmeasured"): measures the prefill speed and the link
        # The first remote requests are cold (connections opened, transport chosen, first
        # forwards): what they teach the speeds and the hop's learnt cost is an outlier that
        # only later remote requests wear off. Warm them up with requests only the prefill
        # pool can serve (prompt logprobs), as a running stack's traffic would.
        for i in range(1, 9):
            assert placed(cluster, 100 + i, prompt_logprobs=0) == ("remote", "prompt_logprobs")
        wait_until(lambda: all(w["prefill_tokens_per_s"] and w.get(
            "kv_transfer_bytes_per_s", 1) for w in gateway_status(cluster)["workers"]
            if w["role"] == "prefill"), 10, "the gateway to see the measured speeds")
        fast = [placed(cluster, i) for i in range(1, 3)]
        assert fast[-1] == ("remote", "cheaper_remote"), (
            fast, gateway_status(cluster)["prefill_placement"]["last"],
            gateway_status(cluster)["prefill_placement"]["handoff_s"])
        cluster.net.shape(prefill.host, SLOW_LINK)
        try:
            slow = []
            while len(slow) < 12 and (not slow or slow[-1][0] == "remote"):
                slow.append(placed(cluster, 10 + len(slow)))
            measured = status(prefill).kv_transfer_bytes_per_s * 8
        finally:
            cluster.net.shape(prefill.host, None)
    finally:
        outcomes = streams.stop()
    assert slow[-1] == ("local", "cheaper_local"), slow
    assert slow[0][0] == "remote"  # priced at the fast link it knew: this one measured the slow
    assert measured < 10 * SLOW_LINK, measured
    assert all(o.code is None for o in outcomes), [o.details for o in outcomes]
