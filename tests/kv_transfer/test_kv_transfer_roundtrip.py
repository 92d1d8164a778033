"""Real transfers over loopback: bit-exact destination blocks, layer-by-layer pipelining,
bounded chunks, bounded queues."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from kv_helpers import LAYOUTS, same_bits, wait_until

from engine_core.kv_cache.layout import KVLayout
from kv_transfer import (
    KVTransferServicer,
    LeaseState,
    LocalControlServer,
    SenderOptions,
    SendState,
    TransferError,
    connect,
)
from kv_transfer.transports.grpc import plan_chunks
from kv_transfer.transports.one_sided import MAX_LAYER_DONE_IN_FLIGHT
from protos.pdserve.internal import kv_transfer_pb2 as pb
from tests.threads import CheckedThread, join_checked

KINDS = ["grpc", "shm"]
# (transport, where LayerDone and Commit go): shm takes the receiver's Unix socket by default,
# and gRPC where the socket cannot be reached
CONTROLS = [("grpc", "grpc"), ("shm", "unix"), ("shm", "grpc")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.dtype}-bs{lay.block_size}")
@pytest.mark.parametrize(("kind", "control"), CONTROLS)
def test_destination_blocks_equal_source_bit_for_bit(make_rig, kind, control, layout):
    rig = make_rig(kind, layout)
    num_blocks = rig.rng.randint(1, 12)
    lease = rig.open(num_blocks)
    src_kv, src_ids = rig.source(num_blocks)
    options = SenderOptions(local_control=control == "unix")
    with connect(kind, rig.target, layout, options=options) as conn:
        assert (conn.kind, conn.control) == (kind, control)
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(layout.num_layers):
            assert session.send_layer(layer, src_kv)
        stats = session.commit(timeout=10)
    assert session.state is SendState.COMMITTED
    assert stats.transport == kind and stats.num_layers == layout.num_layers
    assert stats.num_bytes == layout.num_layers * num_blocks * layout.block_nbytes
    assert rig.table.get(lease.lease_id).state is LeaseState.COMPLETE
    dst_ids = rig.table.claim(lease.lease_id)
    assert dst_ids == list(lease.block_ids)
    assert same_bits(rig.kv[:, dst_ids], src_kv[:, src_ids])
    assert rig.released == []


@pytest.mark.parametrize("kind", KINDS)
def test_layers_ship_as_they_are_computed(make_rig, kind):
    """Each layer reaches the receiver before the next one is even handed over."""
    layout = LAYOUTS[1]
    rig = make_rig(kind, layout)
    lease = rig.open(6)
    src_kv, src_ids = rig.source(6)
    with connect(kind, rig.target, layout) as conn:
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(layout.num_layers):
            session.send_layer(layer, src_kv)
            # a one-sided sender reports the last layer with its Commit, not a LayerDone
            is_last_one_sided = kind != "grpc" and layer + 1 == layout.num_layers
            n = layer if is_last_one_sided else layer + 1

            def arrived(n=n, layer=layer):
                return (rig.table.get(lease.lease_id).num_layers_received == n and same_bits(
                    rig.kv[layer, list(lease.block_ids)], src_kv[layer, src_ids]))

            assert wait_until(arrived), f"layer {layer} did not arrive alone"
            if layer + 1 < layout.num_layers:  # the next layer has not been touched yet
                assert not same_bits(rig.kv[layer + 1, list(lease.block_ids)],
                                     src_kv[layer + 1, src_ids])
        stats = session.commit(timeout=10)
    for layer in range(layout.num_layers - 1):
        assert stats.layer_shipped_s[layer] < stats.layer_queued_s[layer + 1]
    # each layer was gathered into the buffer the one before had been shipped from, and
    # arrived intact (above)
    assert stats.num_snapshot_buffers == 1
    assert stats.commit_seconds < stats.seconds
    assert stats.verify_seconds < stats.commit_rpc_seconds <= stats.commit_seconds


@pytest.mark.parametrize("chunk_blocks", [2.5, 0.3], ids=["several-blocks", "block-pieces"])
def test_grpc_chunks_respect_the_chunk_size(make_rig, chunk_blocks):
    layout = LAYOUTS[0]
    rig = make_rig("grpc", layout)
    chunk_bytes = int(chunk_blocks * layout.block_nbytes)
    lease = rig.open(7)
    src_kv, src_ids = rig.source(7)
    options = SenderOptions(chunk_bytes=chunk_bytes)
    with connect("grpc", rig.target, layout, options=options) as conn:
        assert conn.options.chunk_bytes == chunk_bytes
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(layout.num_layers):
            session.send_layer(layer, src_kv)
        stats = session.commit(timeout=10)
    per_layer = len(list(plan_chunks(7, layout.block_nbytes, chunk_bytes)))
    assert stats.num_chunks == rig.receiver.num_chunks == per_layer * layout.num_layers
    assert 0 < rig.receiver.max_chunk_nbytes <= chunk_bytes
    assert same_bits(rig.kv[:, rig.table.claim(lease.lease_id)], src_kv[:, src_ids])


def test_grpc_chunk_size_is_capped_by_the_receiver(make_rig):
    layout = LAYOUTS[0]
    rig = make_rig("grpc", layout, max_chunk_bytes=layout.block_nbytes)
    with connect("grpc", rig.target, layout, options=SenderOptions(chunk_bytes=1 << 20)) as conn:
        assert conn.options.chunk_bytes == layout.block_nbytes


class GatedLocalControl(LocalControlServer):
    """Holds every LayerDone and Commit on the same-host socket until `gate` opens (as
    GatedServicer does: Begin is answered)."""

    gate = threading.Event()

    def handle(self, data: bytes):
        if pb.LocalControlRequest.FromString(data).WhichOneof("verb") not in ("hello", "begin"):
            self.gate.wait()
        return super().handle(data)


class GatedServicer(KVTransferServicer):
    """Holds every data-plane call until `gate` opens: a receiver that has stalled."""

    gate = threading.Event()

    async def _wait(self) -> None:
        while not self.gate.is_set():
            await asyncio.sleep(0.005)

    async def PushBlocks(self, request_iterator, context):
        await self._wait()
        return await super().PushBlocks(request_iterator, context)

    async def LayerDone(self, request, context):
        await self._wait()
        return await super().LayerDone(request, context)


@pytest.mark.parametrize(("kind", "control"), CONTROLS)
def test_a_stalled_receiver_blocks_send_layer_at_the_queue_bound(make_rig, kind, control):
    """Memory stays bounded: once max_queued_layers snapshots wait, send_layer blocks.
    grpc also lets its HTTP/2 flow-control window (a few MiB, auto-tuned) fill first."""
    # layers of 16 blocks x 32 KiB = 512 KiB; grpc needs enough of them to fill its window,
    # shm enough to exceed the LayerDone calls it pipelines
    num_layers = 16 if kind == "shm" else 24
    layout = KVLayout("big", "float32", block_size=16, num_layers=num_layers, num_kv_heads=4,
                      head_dim=64)
    gate = GatedServicer.gate = GatedLocalControl.gate = threading.Event()
    rig = make_rig(kind, layout, servicer_cls=GatedServicer, local_control_cls=GatedLocalControl)
    lease = rig.open(16)
    src_kv, src_ids = rig.source(16)
    returned = []
    options = SenderOptions(max_queued_layers=2, local_control=control == "unix")
    with connect(kind, rig.target, layout, options=options) as conn:
        assert conn.control == control
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))

        def model_thread():
            for layer in range(layout.num_layers):
                session.send_layer(layer, src_kv)
                returned.append(layer)

        thread = CheckedThread(model_thread)
        thread.start()

        def is_settled() -> bool:  # send_layer stuck, the queue full
            num_returned = len(returned)
            time.sleep(0.2)
            return len(returned) == num_returned and session.num_queued_layers == 2

        assert wait_until(is_settled), thread.error
        assert len(returned) < num_layers and thread.is_alive(), thread.error
        if kind == "shm":  # 8 layers written and unacknowledged, 1 held back, 2 queued
            assert returned == list(range(MAX_LAYER_DONE_IN_FLIGHT + 1 + 2))
        gate.set()
        join_checked([thread], timeout_s=10)
        assert returned == list(range(layout.num_layers))
        session.commit(timeout=10)
    assert same_bits(rig.kv[:, rig.table.claim(lease.lease_id)], src_kv[:, src_ids])


def test_commit_runs_on_the_event_loop_when_only_a_short_check_is_left(make_rig, monkeypatch):
    """A one-sided lease whose reported layers are all checked: the Commit RPC's handler
    checks the last layer itself (a few KB here), with no thread hop; over
    QUICK_HOST_CHECK_BYTES it goes to a thread. Both verify the same way. (Control over gRPC:
    the same-host socket runs every commit on its connection's thread.)"""
    import kv_transfer.receiver.kv_receiver as receiver_module
    import kv_transfer.receiver.servicer as servicer_module

    hops: list[str] = []
    to_thread = asyncio.to_thread

    async def counted(fn, *args, **kwargs):
        hops.append(fn.__name__)
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(servicer_module.asyncio, "to_thread", counted)
    layout = LAYOUTS[1]
    rig = make_rig("shm", layout, local_control_cls=None)

    def transfer() -> None:
        lease = rig.open(4)
        src_kv, src_ids = rig.source(4)
        with connect("shm", rig.target, layout) as conn:
            session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
            for layer in range(layout.num_layers):
                session.send_layer(layer, src_kv)
            assert wait_until(lambda: rig.receiver.num_layers_checked(lease.lease_id)
                              == layout.num_layers - 1)
            session.commit(timeout=10)
        assert rig.table.get(lease.lease_id).state is LeaseState.COMPLETE
        dst_ids = rig.table.claim(lease.lease_id)
        assert same_bits(rig.kv[:, dst_ids], src_kv[:, src_ids])

    transfer()
    assert hops == []
    monkeypatch.setattr(receiver_module, "QUICK_HOST_CHECK_BYTES", layout.block_nbytes)
    transfer()  # the last layer's 4 blocks are over it now
    assert hops == ["commit"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_requested_commit_completes_without_waiting_for_it(make_rig, kind):
    """request_commit() (the prefill engine's, behind the last layer) commits with no thread
    in commit(); the done callbacks run once, the late one at once; commit() then returns
    the stats without waiting."""
    layout = LAYOUTS[1]
    rig = make_rig(kind, layout)
    lease = rig.open(5)
    src_kv, src_ids = rig.source(5)
    with connect(kind, rig.target, layout) as conn:
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        heard: list[str] = []
        session.add_done_callback(lambda: heard.append(threading.current_thread().name))
        for layer in range(layout.num_layers):
            session.send_layer(layer, src_kv)
        assert session.request_commit() and session.request_commit()  # once on its way
        assert wait_until(lambda: rig.table.get(lease.lease_id).state is LeaseState.COMPLETE)
        assert wait_until(lambda: heard) and heard[0].startswith("kv-send-")
        session.add_done_callback(lambda: heard.append("late"))
        assert heard[1:] == ["late"]
        stats = session.commit(timeout=0)
        assert session.state is SendState.COMMITTED and not session.request_commit()
        assert stats.num_bytes == layout.num_layers * 5 * layout.block_nbytes
    assert same_bits(rig.kv[:, rig.table.claim(lease.lease_id)], src_kv[:, src_ids])
    assert len(heard) == 2


def test_a_commit_requested_before_every_layer_is_sent_aborts(make_rig):
    layout = LAYOUTS[1]
    rig = make_rig("shm", layout)
    lease = rig.open(2)
    src_kv, src_ids = rig.source(2)
    with connect("shm", rig.target, layout) as conn:
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        session.send_layer(0, src_kv)
        assert not session.request_commit()
        with pytest.raises(TransferError, match=r"layers \[1, 2, 3\] never sent"):
            session.commit(timeout=5)
    assert wait_until(lambda: len(rig.releases_of(lease.lease_id)) == 1)
