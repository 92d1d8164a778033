"""TransferStats.link_seconds: from the first layer queued to the commit verified, not from
begin() (before the forward's first layer), so that a push that waits for an after-forward
handover still reads its wire time."""

from __future__ import annotations

import pytest

from kv_transfer.send_options import TransferStats


def stats(queued, seconds: float) -> TransferStats:
    return TransferStats("grpc", len(queued), 4, 1000, 4, seconds, 0.01, 0.001, 0.005,
                         tuple(queued), tuple(q + 0.01 for q in queued))


def test_from_the_first_layer_queued_to_the_verified_commit():
    # after-forward: every layer queued at 0.5 s (the forward's end), verified at 0.9 s
    assert stats([0.5, 0.5, 0.5], 0.9).link_seconds == pytest.approx(0.4)
    # layer-wise: layers 0.1 s apart from 0.1 s, verified 20 ms after the last
    assert stats([0.1, 0.2, 0.3], 0.32).link_seconds == pytest.approx(0.22)
