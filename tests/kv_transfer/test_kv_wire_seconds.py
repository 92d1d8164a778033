"""TransferStats.wire_seconds: the time a sender was shipping, without the waits for the next
layer's compute, so that bytes / wire_seconds is the link's speed under a layer-wise push."""

from __future__ import annotations

import pytest

from kv_transfer.send_options import TransferStats


def stats(queued, shipped) -> TransferStats:
    return TransferStats("grpc", len(queued), 4, 1000, 4, 1.0, 0.01, 0.001, 0.005,
                         tuple(queued), tuple(shipped))


def test_waits_for_compute_are_left_out():
    # layers computed 100 ms apart, each shipped in 20 ms: 60 ms on the wire over 0.22 s
    assert stats([0.0, 0.1, 0.2], [0.02, 0.12, 0.22]).wire_seconds == pytest.approx(0.06)


def test_a_backlog_counts_once():
    # all queued at once (the link slower than the compute): the wire was busy throughout
    assert stats([0.0, 0.0, 0.0], [0.1, 0.2, 0.3]).wire_seconds == pytest.approx(0.3)
    # queued while the previous still shipped: from the previous one's end
    assert stats([0.0, 0.05, 0.3], [0.1, 0.2, 0.35]).wire_seconds == pytest.approx(0.25)
