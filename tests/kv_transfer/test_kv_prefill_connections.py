"""The prefill worker's connections to decode workers (prefill_service/service.py) when a
decode worker restarts at its address: a reservation made on the new process replaces the
connection to the old one; a reservation made on the old process, arriving late (it waited
in the prefill queue), fails alone and leaves the current connection, which other requests'
transfers use, open. Real parts: a PrefillServicer over a tiny random model's PrefillEngine,
and a decode-side KV receiver on loopback (tests/kv_transfer/conftest.py)."""

from __future__ import annotations

import asyncio

import pytest
from kv_helpers import wait_until

from engine_core.config import CacheConfig
from kv_transfer import LeaseState, TransferError
from prefill_service.engine import PrefillEngine
from prefill_service.service import PrefillServicer
from service_infra.metrics.worker import KVTransferMetrics, worker_registry
from tests.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> PrefillEngine:
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return PrefillEngine(str(tiny), dtype="float32", device="cpu", quantize_decode=False,
                         cache_config=CacheConfig(num_blocks=32))


@pytest.mark.parametrize("kind", ["grpc", "shm"])
def test_a_late_reservation_of_a_restarted_decode_worker_fails_alone(engine, make_rig, kind):
    rig = make_rig(kind, engine.layout)
    name = engine.source.name
    servicer = PrefillServicer(engine, None, KVTransferMetrics(
        worker_registry("prefill", name, engine), name))
    old = rig.receiver.instance_id

    async def scenario():
        first = await servicer._connection(rig.target, kind, old)
        assert await servicer._connection(rig.target, kind, old) is first  # cached
        rig.receiver.instance_id = "restarted"  # what the new process at the address has
        current = await servicer._connection(rig.target, kind, "restarted")
        assert current is not first and current.receiver_instance == "restarted"
        with pytest.raises(TransferError, match="reservation was made on a previous decode "
                                                "worker.*now restarted"):
            await servicer._connection(rig.target, kind, old)  # a late one of the old process
        assert await servicer._connection(rig.target, kind, "restarted") is current
        return first, current

    first, current = asyncio.run(scenario())
    lease = rig.open(2)
    src_kv, src_ids = rig.source(2)
    with pytest.raises(TransferError, match="closed"):  # the old process's: closed
        first.begin(lease.lease_id, src_ids, list(lease.block_ids))
    session = current.begin(lease.lease_id, src_ids, list(lease.block_ids))  # still open
    for layer in range(rig.layout.num_layers):
        assert session.send_layer(layer, src_kv)
    session.commit(timeout=5)
    assert wait_until(lambda: rig.table.get(lease.lease_id).state is LeaseState.COMPLETE)
    servicer.close()
