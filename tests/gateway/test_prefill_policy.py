"""The cost model that places a prompt's prefill (gateway/disagg/prefill_policy.py), over a table of
cases: each row changes one input of a base case and names the verdict it must give."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.disagg.prefill_policy import (
    PrefillCosts,
    PrefillPolicy,
    decide,
    estimate,
    exposed_transfer_s,
)

# a 20-token follow-up whose history the decode worker caches; both pools prefill 2,000
# tokens/s, a decode step takes 10 ms, the handoff adds 30 ms and the transport moves 1 GB/s
BASE = PrefillCosts(num_local_tokens=20, num_remote_tokens=520, num_transfer_tokens=20,
                    prefill_queue_tokens=0, prefill_tokens_per_s=2000.0,
                    local_tokens_per_s=2000.0, decode_batch=0, decode_step_s=0.010,
                    transfer_bytes_per_s=1e9, kv_bytes_per_token=23_040, handoff_s=0.030)
AUTO = PrefillPolicy()

CASES = [
    # (name, changes to BASE, policy, where, reason)
    ("short follow-up, idle decode worker", {}, AUTO, "local", "cheaper_local"),
    ("nothing measured yet", {"prefill_tokens_per_s": 0.0, "local_tokens_per_s": 0.0}, AUTO,
     "remote", "unmeasured"),
    ("decode worker unmeasured: assumed as fast as the pool", {"local_tokens_per_s": 0.0},
     AUTO, "local", "cheaper_local"),
    ("cold long prompt: the same compute either side, the decodes pay the stall",
     {"num_local_tokens": 900, "num_remote_tokens": 900, "num_transfer_tokens": 900,
      "decode_batch": 8}, AUTO, "remote", "cheaper_remote"),
    ("over --local-prefill-max-tokens", {"num_local_tokens": 1025}, AUTO, "remote",
     "max_local_tokens"),
    ("at --local-prefill-max-tokens", {"num_local_tokens": 1024, "num_remote_tokens": 1024,
                                       "num_transfer_tokens": 1024}, AUTO, "local",
     "cheaper_local"),
    ("a busy decode batch makes even a short prefill cost its decodes more than the hop",
     {"decode_batch": 60, "num_remote_tokens": 20}, AUTO, "remote", "cheaper_remote"),
    ("a long prefill queue sends the prompt local",
     {"num_local_tokens": 400, "num_remote_tokens": 400, "num_transfer_tokens": 400,
      "decode_batch": 4, "prefill_queue_tokens": 8000}, AUTO, "local", "cheaper_local"),
    ("a slow link counts against remote",
     {"num_local_tokens": 300, "num_remote_tokens": 300, "num_transfer_tokens": 300,
      "decode_batch": 1, "handoff_s": 0.0, "transfer_bytes_per_s": 5e6}, AUTO, "local",
     "cheaper_local"),
    ("the same prompt over a link the layer-wise push hides goes remote",
     {"num_local_tokens": 300, "num_remote_tokens": 300, "num_transfer_tokens": 300,
      "decode_batch": 1, "handoff_s": 0.0, "transfer_bytes_per_s": 1e9}, AUTO, "remote",
     "cheaper_remote"),
    ("a fast prefill pool beats a slow decode worker",
     {"num_local_tokens": 300, "num_remote_tokens": 300, "num_transfer_tokens": 300,
      "local_tokens_per_s": 500.0, "prefill_tokens_per_s": 8000.0}, AUTO, "remote",
     "cheaper_remote"),
    ("local prefills already running on the decode worker go first",
     {"num_local_tokens": 100, "num_remote_tokens": 100, "num_transfer_tokens": 100,
      "local_queue_tokens": 600}, AUTO, "remote", "cheaper_remote"),
    ("a history the prefill worker loads from its offload tiers is cheap there",
     {"num_local_tokens": 600, "num_remote_tokens": 8, "num_transfer_tokens": 600,
      "decode_batch": 4, "num_remote_load_tokens": 592, "remote_load_tokens_per_s": 40_000.0},
     AUTO, "remote", "cheaper_remote"),
    ("the same history through a tier that loads slower than compute stays local",
     {"num_local_tokens": 600, "num_remote_tokens": 8, "num_transfer_tokens": 600,
      "decode_batch": 4, "num_remote_load_tokens": 592, "remote_load_tokens_per_s": 200.0},
     AUTO, "local", "cheaper_local"),
    ("always-remote overrides the model", {}, PrefillPolicy("always-remote"), "remote",
     "policy"),
    ("always-local overrides the bound", {"num_local_tokens": 5000},
     PrefillPolicy("always-local"), "local", "policy"),
    ("max 0 keeps auto remote", {}, PrefillPolicy(max_local_tokens=0), "remote",
     "max_local_tokens"),
]


@pytest.mark.parametrize(("changes", "policy", "where", "reason"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decision_table(changes, policy, where, reason):
    got = decide(replace(BASE, **changes), policy)
    assert (got.where, got.reason) == (where, reason)
    if reason.startswith("cheaper"):
        assert (got.local_cost_s < got.remote_cost_s) == (where == "local")


def test_estimate_of_the_base_case_term_by_term():
    local, remote = estimate(BASE, chunk_tokens=128)
    assert local == pytest.approx(20 / 2000)  # idle decode worker: its compute only
    # 20 tokens' KV crosses the link in 0.5 ms, well within the 0.26 s forward: none exposed
    assert remote == pytest.approx(0.030 + 520 / 2000)
    slow = replace(BASE, transfer_bytes_per_s=1e6)  # 1 MB/s: 0.46 s of wire, 0.2 s past it
    assert estimate(slow, chunk_tokens=128)[1] == pytest.approx(
        0.030 + 20 * 23_040 / 1e6 - 520 / 2000 + 520 / 2000)
    busy = replace(BASE, decode_batch=3, num_local_tokens=300)
    local, _ = estimate(busy, chunk_tokens=128)
    # 3 chunks, each also running the decode rows; each of the 3 decodes waits the compute
    assert local == pytest.approx(300 / 2000 + 3 * 0.010 + 3 * 300 / 2000)
    queued = replace(busy, local_queue_tokens=100)
    local, _ = estimate(queued, chunk_tokens=128)
    # it waits for the 100 tokens ahead: 400 tokens in 4 chunks; its own 300 stall the decodes
    assert local == pytest.approx(400 / 2000 + 4 * 0.010 + 3 * 300 / 2000)


def test_estimate_prices_tier_loads_at_their_measured_speed():
    loads = replace(BASE, num_remote_tokens=8, num_remote_load_tokens=512,
                    remote_load_tokens_per_s=32_000.0)
    # the forward of 8 tokens; 512 tokens loaded at 32k tokens/s; 20 tokens' KV cross the
    # link in 0.46 ms, past the 4 ms forward by nothing
    assert estimate(loads, chunk_tokens=128)[1] == pytest.approx(0.030 + 512 / 32_000 + 8 / 2000)
    unmeasured = replace(loads, remote_load_tokens_per_s=0.0)  # free until measured
    assert estimate(unmeasured, chunk_tokens=128)[1] == pytest.approx(0.030 + 8 / 2000)


def test_exposed_transfer_is_the_wire_time_past_the_forward():
    assert exposed_transfer_s(10e6, 1e9, 0.5) == 0.0  # 10 ms of wire inside a 0.5 s forward
    assert exposed_transfer_s(10e6, 1e7, 0.5) == pytest.approx(0.5)  # 1 s of wire
    assert exposed_transfer_s(10e6, 0.0, 0.5) == 0.0  # unmeasured link


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "sometimes"}, "prefill policy must be one of auto, always-remote, always-local, "
                            "got 'sometimes'"),
    ({"max_local_tokens": -1}, "local_prefill_max_tokens must be >= 0, got -1"),
    ({"local_chunk_tokens": 0}, "local_chunk_tokens must be >= 1, got 0"),
])
def test_bad_policy_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefillPolicy(**kwargs)
