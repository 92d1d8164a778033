"""The fake transport (kv_transfer/transports/fake.py) drives a whole handoff in one process
through the registry's plugin interface, on the same loopback rig as grpc and shm, with neither
/dev/shm nor a GPU; and it is offered to tests only."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import LAYOUTS, same_bits, wait_until

from kv_transfer import (
    LeaseEndedError,
    LeaseState,
    SenderOptions,
    SendState,
    TransferError,
    TransportRefusedError,
    connect,
    select_transport,
    transports,
)
from service_infra.metrics.worker import KVTransferMetrics

ENABLED = ("grpc", "fake")  # a receiver serves the fake transport only when told to


def test_the_fake_transport_is_registered_for_tests_only():
    fake = transports.get("fake")
    assert fake.name == "fake" and fake.is_one_sided and fake.checksum_kind == "xxh3"
    assert "fake" in transports.names(include_tests=True)
    assert "fake" not in transports.names()  # CLI choices, the chart's enum
    assert "fake" not in KVTransferMetrics.TRANSPORTS
    assert select_transport("auto", "h", "h", "cpu", "cpu", allowed=ENABLED) == "grpc"
    assert select_transport("fake", "h", "h", "cpu", "cpu", allowed=ENABLED) == "fake"
    with pytest.raises(TransportRefusedError, match="sender host a != receiver host b"):
        select_transport("fake", "a", "b", "cpu", "cpu")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.dtype}-bs{lay.block_size}")
@pytest.mark.parametrize("control", ["unix", "grpc"])
def test_a_handoff_over_the_fake_transport_is_bit_exact(make_rig, layout, control):
    rig = make_rig("fake", layout, allowed_kinds=ENABLED)
    num_blocks = rig.rng.randint(1, 12)
    lease = rig.open(num_blocks)
    src_kv, src_ids = rig.source(num_blocks)
    options = SenderOptions(local_control=control == "unix")
    with connect("fake", rig.target, layout, options=options) as conn:
        assert (conn.kind, conn.control) == ("fake", control)
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(layout.num_layers):
            assert session.send_layer(layer, src_kv)
        stats = session.commit(timeout=10)
    assert session.state is SendState.COMMITTED
    assert stats.transport == "fake" and stats.num_chunks == 0  # written in place, no stream
    assert stats.num_bytes == layout.num_layers * num_blocks * layout.block_nbytes
    finished = rig.table.get(lease.lease_id)
    assert finished.state is LeaseState.COMPLETE
    assert finished.transport == "fake" and finished.is_one_sided
    dst_ids = rig.table.claim(lease.lease_id)
    assert same_bits(rig.kv[:, dst_ids], src_kv[:, src_ids])
    assert rig.released == []


def test_a_corrupted_block_fails_the_fake_transfer_s_verification(make_rig):
    rig = make_rig("fake", LAYOUTS[1], allowed_kinds=ENABLED)
    reported = rig.receiver.layer_done

    def corrupted_on_arrival(lease_id, layer, crc32):  # bytes that arrived wrong
        if layer == 1:
            block = rig.table.get(lease_id).block_ids[0]
            rig.kv[layer, block].view(-1).view(torch.uint8)[17] ^= 0x10  # one bit
        return reported(lease_id, layer, crc32)

    rig.receiver.layer_done = corrupted_on_arrival  # the servicer calls the instance's
    lease = rig.open(3)
    src_kv, src_ids = rig.source(3)
    with connect("fake", rig.target, rig.layout) as conn:
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(rig.layout.num_layers):
            session.send_layer(layer, src_kv)
        with pytest.raises(TransferError, match="DATA_LOSS.*layer 1: destination xxh3"):
            session.commit(timeout=10)
    assert wait_until(lambda: len(rig.releases_of(lease.lease_id)) == 1)
    with pytest.raises(LeaseEndedError, match="FAILED"):
        rig.table.claim(lease.lease_id)


def test_a_receiver_that_does_not_enable_the_fake_transport_refuses_it(make_rig):
    rig = make_rig("grpc", LAYOUTS[0])  # the default: the user-facing transports it can serve
    assert "fake" not in rig.receiver.allowed_kinds
    with pytest.raises(TransportRefusedError, match="transport fake is not enabled"):
        connect("fake", rig.target, rig.layout)
