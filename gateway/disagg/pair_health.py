"""Which (prefill, decode) pairs failed to hand KV over lately: a decode worker the gateway
reaches that its prefill workers cannot (an asymmetric partition) passes every Status and
Reserve, and only its handoffs fail. Routing learns it from those failures.

    failed(P, D)   a handoff P -> D failed in the transfer (not a lost P): the pair is avoided
                   for HOLD_S, then tried again (a healed link is found within HOLD_S)
    ok(P, D)       a handoff P -> D succeeded: the mark goes at once
    is_bad(P, D)   marked and not yet expired
    has_good_pair(D, prefills)   some prefill worker is not marked with D

A pure state machine (no I/O, times given by the caller). Routing only orders by it: when every
choice is marked, the marked ones are still tried (the gateway's canary keeps its own marks:
gateway/disagg/canary.py).
"""

from __future__ import annotations

from collections.abc import Iterable

HOLD_S = 10.0  # how long a failed pair is avoided before traffic tries it again


class PairHealth:
    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._until: dict[tuple[str, str], float] = {}  # (prefill, decode) -> avoid until

    def failed(self, prefill: str, decode: str, now: float) -> None:
        self._until[(prefill, decode)] = now + self.hold_s

    def ok(self, prefill: str, decode: str) -> None:
        self._until.pop((prefill, decode), None)

    def is_bad(self, prefill: str, decode: str, now: float) -> bool:
        until = self._until.get((prefill, decode))
        if until is not None and until <= now:
            del self._until[(prefill, decode)]
            return False
        return until is not None

    def has_good_pair(self, decode: str, prefills: Iterable[str], now: float) -> bool:
        return any(not self.is_bad(p, decode, now) for p in prefills)

    def bad_pairs(self, now: float) -> list[tuple[str, str]]:
        return sorted(pair for pair in list(self._until) if self.is_bad(*pair, now))
