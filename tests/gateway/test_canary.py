"""The canary's verdicts (gateway/disagg/canary.py) as a pure state machine: pairs marked and cleared,
readiness lost after K failed rounds or a round of timeouts, restored by one success; and the
prefill worker routing picks for a decode worker avoiding a pair the canary marked."""

from __future__ import annotations

import asyncio

import pytest

from gateway.disagg.backend import DisaggregatedBackend
from gateway.disagg.canary import CanaryConfig, CanaryState
from gateway.disagg.discovery import StaticDiscovery

P0, P1, D0 = "p0:1", "p1:1", "d0:1"


def test_k_failed_rounds_in_a_row_lose_readiness_and_one_success_restores_it():
    state = CanaryState(failures=3)
    for i in range(2):
        state.record({(P0, D0): ("UNAVAILABLE", 0.1)}, now=float(i))
        assert state.is_ready and state.num_failed_rounds == i + 1
    state.record({(P0, D0): ("UNAVAILABLE", 0.1)}, now=2.0)
    assert not state.is_ready and state.bad_pairs == {(P0, D0)}
    assert state.num_failures == {"UNAVAILABLE": 3} and state.last_success is None
    state.record({(P0, D0): ("ok", 0.05)}, now=3.0)
    assert state.is_ready and state.num_failed_rounds == 0 and state.bad_pairs == set()
    assert (state.last_success, state.last_latency_s) == (3.0, 0.05)


def test_a_round_of_timeouts_loses_readiness_at_once():
    state = CanaryState(failures=3)
    state.record({(P0, D0): ("timeout", 3.0)}, now=0.0)
    assert not state.is_ready


def test_one_good_pair_keeps_readiness_and_the_bad_pair_stays_marked():
    state = CanaryState(failures=1)
    state.record({(P0, D0): ("timeout", 3.0), (P1, D0): ("ok", 0.1)}, now=0.0)
    assert state.is_ready and state.bad_pairs == {(P0, D0)}
    state.record({(P0, D0): ("ok", 0.1), (P1, D0): ("ok", 0.1)}, now=1.0)
    assert state.bad_pairs == set()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"idle_s": -1}, "canary_idle_s must be >= 0, canary_timeout_s > 0 and canary_failures "
                     ">= 1, got -1, 3.0 and 3"),
    ({"timeout_s": 0}, "got 10.0, 0 and 3"),
    ({"failures": 0}, "got 10.0, 3.0 and 0"),
])
def test_bad_canary_flags_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CanaryConfig(**kwargs)
    assert CanaryConfig().is_on and not CanaryConfig(idle_s=0).is_on


def test_routing_gives_a_decode_worker_another_prefill_worker_than_a_bad_pair():
    async def scenario() -> None:
        backend = DisaggregatedBackend(StaticDiscovery(["p0:1", "p1:1"], ["d0:1", "d1:1"]),
                                       tokenizer=None)
        await backend.pools.discover()  # channels are lazy: nothing is dialled
        for w in backend.prefill + backend.decode:
            w.is_healthy = True
        d0, d1 = backend.decode
        prompt = list(range(40))
        picked = await backend.handoff.pick_prefill(prompt, decode=d0)
        other = next(w for w in backend.prefill if w is not picked)
        backend.canary_monitor.state.bad_pairs.add((picked.address, d0.address))
        assert await backend.handoff.pick_prefill(prompt, decode=d0) is other
        assert await backend.handoff.pick_prefill(prompt, decode=d1) is picked  # only that pair
        # every pair of d0 bad: it still gets a prefill worker (the canary may be wrong)
        backend.canary_monitor.state.bad_pairs.add((other.address, d0.address))
        assert await backend.handoff.pick_prefill(prompt, decode=d0) in backend.prefill
        await backend.close()

    asyncio.run(scenario())
