"""Everything that can go wrong in a handoff ends the lease exactly once and frees its blocks:
aborts from either side, a stalled or killed sender, corrupted bytes, mismatched layouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from kv_helpers import LAYOUTS, same_bits, wait_until

from engine_core.kv_cache.layout import KVLayout
from kv_transfer import (
    KVTransferServicer,
    LayoutMismatchError,
    LeaseEndedError,
    LeaseState,
    SenderOptions,
    TransferError,
    TransportRefusedError,
    connect,
    wire,
)
from kv_transfer.checksum import checksum_blocks_as
from protos.pdserve.internal import kv_transfer_pb2 as pb
from protos.pdserve.internal import kv_transfer_pb2_grpc as pb_grpc

KINDS = ["grpc", "shm"]
REPO = Path(__file__).resolve().parents[2]


def start(rig, kind, num_blocks=4, ttl_s=10.0, num_layers_sent=1):
    """A connection and a session that has shipped its first layers (seen by the receiver)."""
    lease = rig.open(num_blocks, ttl_s)
    src_kv, src_ids = rig.source(num_blocks)
    conn = connect(kind, rig.target, rig.layout)
    session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
    for layer in range(num_layers_sent):
        assert session.send_layer(layer, src_kv)
    assert wait_until(lambda: rig.table.get(lease.lease_id).num_layers_received
                      == num_reported(kind, rig.layout, num_layers_sent))
    return conn, session, lease, src_kv


def num_reported(kind, layout, num_layers_sent):
    """Layers the receiver hears of before commit: a one-sided sender reports the layer that
    completes the set with its Commit, not with a LayerDone."""
    return num_layers_sent - (kind != "grpc" and num_layers_sent == layout.num_layers)


@pytest.mark.parametrize("kind", KINDS)
def test_sender_abort_releases_once_and_refuses_later_data(make_rig, kind):
    rig = make_rig(kind, LAYOUTS[1])
    conn, session, lease, src_kv = start(rig, kind, num_layers_sent=2)
    with conn:
        assert session.abort("client cancelled") is True
        assert session.abort("again") is False
        assert [(x.state, reason) for x, reason in rig.releases_of(lease.lease_id)] == \
            [(LeaseState.ABORTED, "client cancelled")]
        assert session.send_layer(2, src_kv) is False
        with pytest.raises(TransferError, match="aborted by the sender: client cancelled"):
            session.commit(timeout=5)
    stub = pb_grpc.KVTransferStub(grpc.insecure_channel(rig.target))
    chunk = pb.KVChunk(lease_id=lease.lease_id, layer=3, dst_block_ids=[lease.block_ids[0]],
                       data=bytes(rig.layout.block_nbytes))
    with pytest.raises(grpc.RpcError) as err:
        stub.PushBlocks(iter([pb.PushBlocksRequest(chunk=chunk)]), timeout=5)
    assert err.value.code() is grpc.StatusCode.ABORTED
    with pytest.raises(grpc.RpcError) as err:
        stub.LayerDone(pb.LayerDoneRequest(lease_id=lease.lease_id, layer=3), timeout=5)
    assert err.value.code() is grpc.StatusCode.ABORTED
    assert len(rig.releases_of(lease.lease_id)) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_abort_fails_the_senders_commit(make_rig, kind):
    rig = make_rig(kind, LAYOUTS[1])
    conn, session, lease, src_kv = start(rig, kind)
    with conn:
        assert rig.table.abort(lease.lease_id, "decode cancelled") is True
        if kind == "shm":  # the sender may be writing: blocks kept until it acknowledges
            assert rig.releases_of(lease.lease_id) == []
        for layer in range(1, rig.layout.num_layers):
            session.send_layer(layer, src_kv)  # False once the session has noticed
        with pytest.raises(TransferError, match="ABORTED.*decode cancelled") as err:
            session.commit(timeout=5)
        assert err.value.code == "ABORTED"
    assert wait_until(lambda: len(rig.releases_of(lease.lease_id)) == 1)
    assert rig.table.get(lease.lease_id).state is LeaseState.ABORTED


@pytest.mark.parametrize("kind", KINDS)
def test_a_stalled_sender_lets_the_lease_expire(make_rig, kind):
    rig = make_rig(kind, LAYOUTS[0])
    conn, session, lease, src_kv = start(rig, kind, ttl_s=0.6)
    with conn:
        # grpc: released at the deadline. shm: the sender's process runs, so its blocks wait
        # for its word that it stopped writing: its session gives up rpc_timeout_s (5 s) after
        # the deadline when no layer comes, and says so.
        assert wait_until(lambda: rig.releases_of(lease.lease_id), timeout_s=15)
        [(released, reason)] = rig.releases_of(lease.lease_id)
        assert released.state is LeaseState.EXPIRED and "RECEIVING (1 layers" in reason
        assert rig.table.num_blocks_held == 0
        for layer in range(1, rig.layout.num_layers):
            session.send_layer(layer, src_kv)
        with pytest.raises(TransferError):
            session.commit(timeout=5)
    assert len(rig.releases_of(lease.lease_id)) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupted_destination_block_fails_verification(make_rig, kind):
    rig = make_rig(kind, LAYOUTS[1])
    layout = rig.layout
    layer = 2
    reported = rig.receiver.layer_done

    def corrupted_on_arrival(lease_id, done_layer, crc32):  # bytes that arrived wrong
        if done_layer == layer:
            block = rig.table.get(lease_id).block_ids[1]
            rig.kv[layer, block].view(-1).view(torch_uint8())[17] ^= 0x10
        return reported(lease_id, done_layer, crc32)

    rig.receiver.layer_done = corrupted_on_arrival  # the servicer calls the instance's
    conn, session, lease, src_kv = start(rig, kind, num_layers_sent=layout.num_layers)
    with conn, pytest.raises(TransferError, match=f"DATA_LOSS.*layer {layer}: destination") \
            as err:
        session.commit(timeout=5)
    assert err.value.code == "DATA_LOSS"
    [(released, reason)] = rig.releases_of(lease.lease_id)
    assert released.state is LeaseState.FAILED and "verification failed" in reason
    with pytest.raises(LeaseEndedError, match="FAILED"):
        rig.table.claim(lease.lease_id)


@pytest.mark.parametrize("kind", KINDS)
def test_each_layer_is_checked_on_arrival_and_commit_only_collects(make_rig, kind, monkeypatch):
    """The receiver checks a layer when it is reported done, off the caller's thread; once the
    checks are in, commit computes a checksum only of a layer reported by the commit itself (a
    one-sided sender's last). An abort drops a lease's checks."""
    import kv_transfer.receiver.kv_receiver as receiver_module

    rig = make_rig(kind, LAYOUTS[1])
    n = rig.layout.num_layers
    conn, session, lease, src_kv = start(rig, kind, num_layers_sent=n)
    reported = num_reported(kind, rig.layout, n)
    assert wait_until(lambda: rig.receiver.num_layers_checked(lease.lease_id) == reported)
    at_commit = []

    def checksum_at_commit(kind_, kv_layer, block_ids):
        at_commit.append(next(i for i in range(n) if rig.kv[i].data_ptr() == kv_layer.data_ptr()))
        return checksum_blocks_as(kind_, kv_layer, block_ids)

    monkeypatch.setattr(receiver_module, "checksum_blocks_as", checksum_at_commit)
    with conn:
        stats = session.commit(timeout=5)
    assert stats.num_layers == n and rig.table.claim(lease.lease_id) == list(lease.block_ids)
    assert at_commit == list(range(reported, n))  # [] for grpc, [n - 1] for shm
    monkeypatch.undo()
    conn, session, aborted, _ = start(rig, kind, num_blocks=2, num_layers_sent=2)
    assert wait_until(lambda: rig.receiver.num_layers_checked(aborted.lease_id) == 2)
    with conn:
        assert session.abort("client cancelled") is True
    assert rig.receiver.num_layers_checked(aborted.lease_id) == 0  # dropped with the lease


def torch_uint8():
    import torch

    return torch.uint8


def test_layout_mismatch_is_refused_naming_every_field(make_rig):
    rig = make_rig("grpc", LAYOUTS[0])
    theirs = KVLayout("tiny", "bfloat16", block_size=16, num_layers=30, num_kv_heads=2,
                      head_dim=64)
    with pytest.raises(LayoutMismatchError) as err:
        connect("grpc", rig.target, theirs)
    assert err.value.mismatches == ["dtype: 'bfloat16' != 'float32'", "num_layers: 30 != 3",
                                    "head_dim: 64 != 32"]


class NewerReceiver(KVTransferServicer):
    """A receiver of the next protocol version, as far as its handshake tells."""

    async def Handshake(self, request, context):
        reply = await super().Handshake(request, context)
        reply.protocol_version = wire.PROTOCOL_VERSION + 1
        return reply


def test_another_protocol_version_is_refused_at_the_handshake_either_way(make_rig):
    """A pool upgraded apart from the other fails at connect, FAILED_PRECONDITION naming
    both versions, not at every transfer's verification; a build older than the field (it
    sends 0) speaks version 1."""
    rig = make_rig("grpc", LAYOUTS[0])
    stub = pb_grpc.KVTransferStub(grpc.insecure_channel(rig.target))
    request = pb.HandshakeRequest(layout=wire.layout_to_proto(rig.layout),
                                  transport=pb.TRANSPORT_KIND_GRPC, sender_host_id="h",
                                  sender_device="cpu")
    for version in (0, wire.PROTOCOL_VERSION):  # an older build's, and this one's
        request.protocol_version = version
        assert stub.Handshake(request, timeout=10).protocol_version == wire.PROTOCOL_VERSION
    request.protocol_version = wire.PROTOCOL_VERSION + 1  # a newer sender
    with pytest.raises(grpc.RpcError) as err:
        stub.Handshake(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (f"kv protocol version: {wire.PROTOCOL_VERSION + 1} != {wire.PROTOCOL_VERSION}"
            in err.value.details())

    newer = make_rig("grpc", LAYOUTS[0], servicer_cls=NewerReceiver)
    with pytest.raises(LayoutMismatchError) as refused:
        connect("grpc", newer.target, newer.layout)
    assert refused.value.mismatches == [
        f"kv protocol version: {wire.PROTOCOL_VERSION} != {wire.PROTOCOL_VERSION + 1} "
        f"(run both pools at one pdserve release)"]
    assert newer.table.leases() == [] and rig.table.leases() == []


def test_explicit_shm_across_hosts_is_refused_and_auto_uses_grpc(make_rig, monkeypatch):
    rig = make_rig("shm", LAYOUTS[0], host="decode-host")
    monkeypatch.setenv("PDSERVE_HOST_ID", "prefill-host")
    with pytest.raises(TransportRefusedError, match="prefill-host != receiver host decode-host"):
        connect("shm", rig.target, rig.layout)
    with connect("auto", rig.target, rig.layout) as conn:
        assert conn.kind == "grpc"


# the sender of the next test, in a mount namespace of its own with a fresh /dev/shm
_SENDER_IN_OWN_SHM = """
import sys, torch
from kv_transfer import connect
from tests.kv_transfer.kv_helpers import LAYOUTS
target, lease_id, src_ids, dst_ids, src_path = sys.argv[1:]
src = torch.load(src_path)
with connect("auto", target, LAYOUTS[0]) as conn:
    print("chosen", conn.kind, "fallback from", conn.fallback_from, flush=True)
    session = conn.begin(lease_id, eval(src_ids), eval(dst_ids))
    for layer in range(LAYOUTS[0].num_layers):
        session.send_layer(layer, src)
    session.commit(timeout=10)
"""


def test_auto_uses_grpc_where_the_shm_pool_is_out_of_reach(make_rig, tmp_path):
    """Two containers on one kernel (same host id) that share no /dev/shm: auto picks shm by
    the host ids, the sender cannot map the pool, and the handoff goes over grpc instead of
    failing every request. The sender runs in a mount namespace with a /dev/shm of its own."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a mount namespace of its own (unshare -m as root): {probe.stderr}")
    rig = make_rig("shm", LAYOUTS[0])
    lease = rig.open(3)
    src, src_ids = rig.source(3)
    torch.save(src, tmp_path / "src.pt")
    command = (f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c "
               f"'{_SENDER_IN_OWN_SHM}' {rig.target} {lease.lease_id} '{src_ids}' "
               f"'{list(lease.block_ids)}' {tmp_path / 'src.pt'}")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "chosen grpc fallback from shm" in done.stdout
    assert "shm cannot map the receiver's pool here" in done.stderr
    assert "cannot be opened here" in done.stderr  # the reason, in the sender's log
    assert rig.table.get(lease.lease_id).state is LeaseState.COMPLETE
    assert rig.table.claim(lease.lease_id) == list(lease.block_ids)
    assert same_bits(rig.kv[:, list(lease.block_ids)], src[:, src_ids])


def test_cuda_ipc_without_cuda_is_refused(make_rig):
    rig = make_rig("grpc", LAYOUTS[0])
    with pytest.raises(TransportRefusedError, match="cuda_ipc"):
        connect("cuda_ipc", rig.target, rig.layout)


def test_a_ticket_with_other_blocks_fails_and_frees_the_lease(make_rig):
    rig = make_rig("grpc", LAYOUTS[0])
    lease = rig.open(3)
    src_kv, src_ids = rig.source(3)
    with connect("grpc", rig.target, rig.layout) as conn:
        session = conn.begin(lease.lease_id, src_ids, list(reversed(lease.block_ids)))
        for layer in range(rig.layout.num_layers):
            session.send_layer(layer, src_kv)  # False once Begin has been refused
        with pytest.raises(TransferError, match="FAILED_PRECONDITION.*not the lease's blocks"):
            session.commit(timeout=5)
    assert [x.state for x, _ in rig.releases_of(lease.lease_id)] == [LeaseState.ABORTED]


@pytest.mark.parametrize("kind", KINDS)
def test_a_connection_to_a_previous_receiver_writes_nothing(make_rig, kind):
    """A decode worker restarted at the same address has a new receiver instance (and, for
    shm, a new pool file): a sender still holding the old connection is refused at Begin,
    before any byte lands in the old mapping, and a new handshake then works."""
    rig = make_rig(kind, LAYOUTS[0])
    lease = rig.open(3)
    src_kv, src_ids = rig.source(3)
    before = rig.kv.clone()
    with connect(kind, rig.target, rig.layout) as conn:
        assert conn.receiver_instance == rig.receiver.instance_id
        rig.receiver.instance_id = "a-restarted-process"  # what a new process would have
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(rig.layout.num_layers):
            session.send_layer(layer, src_kv)  # False once Begin has been refused
        with pytest.raises(TransferError, match="FAILED_PRECONDITION.*handshake again"):
            session.commit(timeout=5)
    assert same_bits(rig.kv, before)  # nothing was written
    assert [x.state for x, _ in rig.releases_of(lease.lease_id)] == [LeaseState.ABORTED]
    lease = rig.open(3)
    with connect(kind, rig.target, rig.layout) as conn:  # the new handshake's instance works
        assert conn.receiver_instance == "a-restarted-process"
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(rig.layout.num_layers):
            assert session.send_layer(layer, src_kv)
        session.commit(timeout=5)
    assert same_bits(rig.kv[:, lease.block_ids], src_kv[:, src_ids])


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_connection_aborts_its_transfers_and_refuses_new_ones(make_rig, kind):
    """A prefill worker closes a connection after a transfer on it failed (the decode worker
    may be gone), while the engine thread may be about to begin another transfer on it:
    that begin fails with TransferError (the request is run again), not with an
    AttributeError on the unmapped pool, and the running transfer ends its lease once."""
    rig = make_rig(kind, LAYOUTS[0])
    conn, session, lease, _ = start(rig, kind)
    conn.close()
    with pytest.raises(TransferError, match="aborted by the sender: connection closed"):
        session.commit(timeout=5)
    assert [x.state for x, _ in rig.releases_of(lease.lease_id)] == [LeaseState.ABORTED]
    later = rig.open(2)
    _, src_ids = rig.source(2)
    with pytest.raises(TransferError, match="was closed after a failed transfer"):
        conn.begin(later.lease_id, src_ids, list(later.block_ids))
    assert rig.table.get(later.lease_id).state is LeaseState.RESERVED  # no sender began


_KILLED_SENDER = """
import json, sys, time
import torch
from engine_core.kv_cache.layout import KVLayout
from kv_transfer import connect
args = json.loads(sys.argv[1])
layout = KVLayout(**args["layout"])
kv = torch.randn(layout.cache_shape(args["num_src_blocks"])).to(layout.torch_dtype)
conn = connect(args["kind"], args["target"], layout)
print("ready", flush=True)
lease_id, dst = json.loads(sys.stdin.readline())
session = conn.begin(lease_id, list(range(len(dst))), dst)
session.send_layer(0, kv)
print("sent", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_sender_killed_mid_transfer_releases_the_lease(make_rig, kind):
    rig = make_rig(kind, LAYOUTS[1])
    layout = rig.layout
    args = {"layout": layout.__dict__, "kind": kind, "target": rig.target, "num_src_blocks": 8}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SENDER, json.dumps(args)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "ready"
        lease = rig.open(5, ttl_s=1.0)
        child.stdin.write(json.dumps([lease.lease_id, list(lease.block_ids)]) + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "sent"
        assert wait_until(lambda: rig.table.get(lease.lease_id).num_layers_received == 1)
        child.send_signal(signal.SIGKILL)  # mid-transfer: 1 of 4 layers delivered
        child.wait(timeout=10)
        assert wait_until(lambda: rig.releases_of(lease.lease_id), timeout_s=5)
    finally:
        child.kill()
        child.wait()
    [(released, reason)] = rig.releases_of(lease.lease_id)
    # grpc: the broken stream aborts at once; shm: no stream, so the deadline expires it
    expected = {"grpc": LeaseState.ABORTED, "shm": LeaseState.EXPIRED}[kind]
    assert released.state is expected, reason
    assert rig.table.num_blocks_held == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_longer_than_the_ttl_completes_while_each_layer_comes_in_time(make_rig,
                                                                                 kind):
    """Each layer delivered gives the lease its ttl again, so a slow forward (a long prompt
    on a CPU) whose layers each come within the ttl completes, however long it takes in all:
    the sender's stream and waits follow that, not the deadline the lease had at Begin."""
    layout = KVLayout("slow", "float32", block_size=16, num_layers=8, num_kv_heads=2,
                      head_dim=32)
    rig = make_rig(kind, layout)
    lease = rig.open(2, ttl_s=1.0)
    src_kv, src_ids = rig.source(2)
    with connect(kind, rig.target, layout, options=SenderOptions(rpc_timeout_s=1.0)) as conn:
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(layout.num_layers):  # 8 x 0.4 s: 3.2 s, past ttl + rpc timeout
            time.sleep(0.4)
            assert session.send_layer(layer, src_kv), f"layer {layer} refused"
        session.commit(timeout=5)
    assert rig.table.get(lease.lease_id).state is LeaseState.COMPLETE
    assert same_bits(rig.kv[:, rig.table.claim(lease.lease_id)], src_kv[:, src_ids])
