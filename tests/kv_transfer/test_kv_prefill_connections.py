"""The prefill worker's side of the handoff (prefill_service/): its commit, requested behind
the last layer and awaited on the loop; and its connections to decode workers when a
decode worker restarts at its address: a reservation made on the new process replaces the
connection to the old one; a reservation made on the old process, arriving late (it waited
in the prefill queue), fails alone and leaves the current connection, which other requests'
transfers use, open. Real parts: a PrefillWorker over a tiny random model's PrefillEngine,
and a decode-side KV receiver on loopback (tests/kv_transfer/conftest.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from kv_helpers import LAYOUTS, same_bits, wait_until

from engine_core.engine_config import CacheConfig, DeviceConfig, LoadConfig
from kv_transfer import LeaseState, TransferError, connect
from prefill_service.engine import HandoffStep, HandoffTarget, PrefillEngine
from prefill_service.worker import PrefillWorker, _committed
from service_infra.metrics.worker import KVTransferMetrics, worker_registry
from tests.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> PrefillEngine:
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return PrefillEngine(LoadConfig(str(tiny), dtype="float32", quantize_decode=False),
                         DeviceConfig("cpu"), CacheConfig(num_blocks=32))


@pytest.mark.parametrize("kind", ["grpc", "shm"])
def test_a_late_reservation_of_a_restarted_decode_worker_fails_alone(engine, make_rig, kind):
    rig = make_rig(kind, engine.layout)
    name = engine.source.name
    registry = worker_registry("prefill", name, engine)
    worker = PrefillWorker(engine, None, KVTransferMetrics(registry, name))
    active = lambda: registry.get_sample_value(  # noqa: E731
        "pdserve:kv_transfers_active", {"model_name": name, "transport": kind})
    old = rig.receiver.instance_id

    async def scenario():
        first = await worker._connection(rig.target, kind, old)
        assert await worker._connection(rig.target, kind, old) is first  # cached
        rig.receiver.instance_id = "restarted"  # what the new process at the address has
        current = await worker._connection(rig.target, kind, "restarted")
        assert current is not first and current.receiver_instance == "restarted"
        with pytest.raises(TransferError, match="reservation was made on a previous decode "
                                                "worker.*now restarted"):
            await worker._connection(rig.target, kind, old)  # a late one of the old process
        assert await worker._connection(rig.target, kind, "restarted") is current
        return first, current

    first, current = asyncio.run(scenario())
    lease = rig.open(2)
    src_kv, src_ids = rig.source(2)
    with pytest.raises(TransferError, match="closed"):  # the old process's: closed
        first.begin(lease.lease_id, src_ids, list(lease.block_ids))
    assert active() == 0
    session = current.begin(lease.lease_id, src_ids, list(lease.block_ids))  # still open
    assert active() == 1  # begun: in flight until the receiver's verdict
    for layer in range(rig.layout.num_layers):
        assert session.send_layer(layer, src_kv)
    session.commit(timeout=5)
    assert active() == 0
    assert wait_until(lambda: rig.table.get(lease.lease_id).state is LeaseState.COMPLETE)
    worker.close()


@pytest.mark.parametrize("layers_computed", ["all", "some"])
def test_the_handoff_commits_behind_the_last_layer_and_the_loop_awaits_it(make_rig,
                                                                          layers_computed):
    """HandoffStep (the prefill engine's connector) requests the commit as the last layer is
    handed over, before the step ends; the service's loop awaits the verdict with no thread
    parked on it. A forward that failed midway aborts the transfer at the step's end."""
    layout = LAYOUTS[1]
    rig = make_rig("shm", layout)
    lease = rig.open(3)
    src_kv, src_ids = rig.source(3)
    sent = []
    with connect("shm", rig.target, layout) as conn:
        target = HandoffTarget(conn, lease.lease_id, list(lease.block_ids), 0,
                               lambda session, error: sent.append((session, error)))
        target.session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        step = HandoffStep([target], src_kv)
        num_computed = layout.num_layers if layers_computed == "all" else 2
        for layer in range(num_computed):
            step.save_layer(layer)
        if layers_computed == "all":  # committed before the step is over
            assert wait_until(lambda: rig.table.get(lease.lease_id).state
                              is LeaseState.COMPLETE)
        step.finish()
        assert sent == [(target.session, None)]
        if layers_computed == "all":
            stats = asyncio.run(_committed(target.session, 5.0))
            assert stats.num_bytes == layout.num_layers * 3 * layout.block_nbytes
            assert same_bits(rig.kv[:, rig.table.claim(lease.lease_id)], src_kv[:, src_ids])
        else:
            with pytest.raises(TransferError, match=r"layers \[2, 3\] never sent"):
                asyncio.run(_committed(target.session, 5.0))
            assert wait_until(lambda: len(rig.releases_of(lease.lease_id)) == 1)


def test_after_forward_nothing_leaves_before_the_step_ends(make_rig):
    """--kv-push after-forward (the layer-wise push's baseline): nothing begins or ships during
    the forward (the lease waits no forward for its first layer); the step's end begins the
    transfer, hands every layer over and commits; the receiver gets the same bits."""
    layout = LAYOUTS[1]
    rig = make_rig("grpc", layout)
    lease = rig.open(3)
    src_kv, src_ids = rig.source(3)
    sent = []
    with connect("grpc", rig.target, layout) as conn:
        target = HandoffTarget(conn, lease.lease_id, list(lease.block_ids), 0,
                               lambda session, error: sent.append((session, error)),
                               src_block_ids=src_ids)
        step = HandoffStep([target], src_kv, is_layerwise=False)
        for layer in range(layout.num_layers):
            step.save_layer(layer)
        time.sleep(0.3)  # a layer-wise push would have delivered by now
        assert target.session is None
        assert rig.table.get(lease.lease_id).state is LeaseState.RESERVED
        step.finish()
        stats = asyncio.run(_committed(target.session, 5.0))
        assert sent == [(target.session, None)]
        assert stats.num_bytes == layout.num_layers * 3 * layout.block_nbytes
        assert same_bits(rig.kv[:, rig.table.claim(lease.lease_id)], src_kv[:, src_ids])
