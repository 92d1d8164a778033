"""gateway/disagg/pair_health.py: a (prefill, decode) pair whose handoff failed is avoided for
HOLD_S, cleared by a success, and a decode worker with no good pair left is known as such."""

from __future__ import annotations

from gateway.disagg.pair_health import PairHealth


def test_a_failed_pair_is_avoided_until_it_expires_or_succeeds():
    h = PairHealth(hold_s=10.0)
    h.failed("p0", "d0", now=100.0)
    assert h.is_bad("p0", "d0", 105.0) and not h.is_bad("p1", "d0", 105.0)
    assert not h.is_bad("p0", "d1", 105.0)
    assert h.bad_pairs(105.0) == [("p0", "d0")]
    assert not h.is_bad("p0", "d0", 110.0)  # expired: traffic tries the pair again
    assert h.bad_pairs(110.0) == []
    h.failed("p0", "d0", now=200.0)
    h.ok("p0", "d0")
    assert not h.is_bad("p0", "d0", 201.0)


def test_a_decode_worker_every_prefill_worker_failed_has_no_good_pair():
    h = PairHealth(hold_s=10.0)
    h.failed("p0", "d0", now=0.0)
    assert h.has_good_pair("d0", ["p0", "p1"], 1.0)
    h.failed("p1", "d0", now=1.0)
    assert not h.has_good_pair("d0", ["p0", "p1"], 2.0)
    assert h.has_good_pair("d1", ["p0", "p1"], 2.0)
    assert h.has_good_pair("d0", ["p0", "p1"], 10.5)  # p0's mark expired first
