"""The same-host control socket (kv_transfer/receiver/control_server.py, control_client.py):
an shm sender's Begin, LayerDone and Commit go over it instead of gRPC (Begin where the
receiver's handshake says it takes it), its errors carry the RPCs'
status names, every failure frees the lease, and a sender that cannot reach it keeps its
control on gRPC."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import tempfile
import threading

import pytest
from kv_helpers import LAYOUTS, same_bits, wait_until

from kv_transfer import (
    KVTransferServicer,
    LeaseState,
    LocalControlServer,
    SenderOptions,
    TransferError,
    connect,
)
from kv_transfer.control_client import LocalControlClient
from kv_transfer.receiver.control_server import SOCKET_PREFIX, reap_stale_sockets
from kv_transfer.wire import MAX_CONTROL_MESSAGE_BYTES
from protos.pdserve.internal import kv_transfer_pb2 as pb
from tests.threads import CheckedThread, join_checked

LAYOUT = LAYOUTS[1]  # 4 layers: 3 LayerDones and a Commit per transfer


class CountingServicer(KVTransferServicer):
    """Records the control RPCs that reach the gRPC service."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    async def Begin(self, request, context):
        self.calls.append("Begin")
        return await super().Begin(request, context)

    async def LayerDone(self, request, context):
        self.calls.append("LayerDone")
        return await super().LayerDone(request, context)

    async def Commit(self, request, context):
        self.calls.append("Commit")
        return await super().Commit(request, context)


def _send_all(rig, conn, num_blocks: int = 4):
    """Begin a transfer of random blocks and hand over every layer; (lease, session, source
    cache, source ids)."""
    lease = rig.open(num_blocks)
    src_kv, src_ids = rig.source(num_blocks)
    session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
    for layer in range(rig.layout.num_layers):
        assert session.send_layer(layer, src_kv)
    return lease, session, src_kv, src_ids


def _claimed_bits_equal(rig, lease, src_kv, src_ids) -> bool:
    assert rig.table.get(lease.lease_id).state is LeaseState.COMPLETE
    return same_bits(rig.kv[:, rig.table.claim(lease.lease_id)], src_kv[:, src_ids])


def test_shm_begin_layer_done_and_commit_take_the_socket_and_reuse_one_connection(make_rig):
    rig = make_rig("shm", LAYOUT, servicer_cls=CountingServicer)
    servicer = rig.server.servicer
    with connect("shm", rig.target, LAYOUT) as conn:
        assert conn.control == "unix"
        for _ in range(3):
            lease, session, src_kv, src_ids = _send_all(rig, conn)
            stats = session.commit(timeout=10)
            assert stats.commit_rpc_seconds > 0 and stats.verify_seconds > 0
            assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
    assert servicer.calls == []  # nothing but Handshake reached gRPC
    # the connect()'s hello, then a Begin, 3 LayerDones and a Commit per transfer, on one
    # connection
    assert rig.local.num_requests == 1 + 3 * (1 + LAYOUT.num_layers)
    assert rig.local.num_connections == 1

    with connect("shm", rig.target, LAYOUT,
                 options=SenderOptions(local_control=False)) as conn:
        assert conn.control == "grpc"
        lease, session, src_kv, src_ids = _send_all(rig, conn)
        session.commit(timeout=10)
        assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
    assert servicer.calls == ["Begin"] + ["LayerDone"] * (LAYOUT.num_layers - 1) + ["Commit"]
    assert rig.local.num_requests == 1 + 3 * (1 + LAYOUT.num_layers)


class BeginOnGrpcServicer(CountingServicer):
    """A receiver older than HandshakeResponse.local_control_begin: its socket takes LayerDone
    and Commit only."""

    async def Handshake(self, request, context):
        reply = await super().Handshake(request, context)
        reply.local_control_begin = False
        return reply


def test_a_receiver_whose_socket_takes_no_begin_gets_it_over_grpc(make_rig):
    rig = make_rig("shm", LAYOUT, servicer_cls=BeginOnGrpcServicer)
    with connect("shm", rig.target, LAYOUT) as conn:
        assert conn.control == "unix"
        lease, session, src_kv, src_ids = _send_all(rig, conn)
        session.commit(timeout=10)
        assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
    assert rig.server.servicer.calls == ["Begin"]
    assert rig.local.num_requests == 1 + LAYOUT.num_layers  # hello, LayerDones, Commit


def test_concurrent_sessions_each_hold_a_connection_and_their_replies_never_cross(make_rig):
    rig = make_rig("shm", LAYOUT)
    with connect("shm", rig.target, LAYOUT) as conn:
        transfers = [_send_all(rig, conn, num_blocks=3) for _ in range(4)]
        # every session has had its LayerDones answered and holds its connection until commit
        assert wait_until(lambda: all(
            rig.receiver.num_layers_checked(lease.lease_id) == LAYOUT.num_layers - 1
            for lease, *_ in transfers))
        threads = [CheckedThread(session.commit, 10) for _, session, *_ in transfers]
        for thread in threads:
            thread.start()
        join_checked(threads, timeout_s=10)
        assert rig.local.num_connections == 4  # the hello's, then one more per session
        for lease, _, src_kv, src_ids in transfers:
            assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
        lease, session, src_kv, src_ids = _send_all(rig, conn)  # an idle connection is reused
        session.commit(timeout=10)
        assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
        assert rig.local.num_connections == 4


def test_a_full_socket_refuses_one_more_sender_whose_control_stays_on_grpc(make_rig):
    """At max_connections the receiver answers one more connection's hello with
    RESOURCE_EXHAUSTED: that session sends its Begin, LayerDones and Commit over gRPC and
    commits, and the next session is back on the socket."""
    rig = make_rig("shm", LAYOUT, servicer_cls=CountingServicer,
                   local_control_cls=functools.partial(LocalControlServer, max_connections=2))
    with connect("shm", rig.target, LAYOUT) as conn:
        assert conn.control == "unix"  # the hello's connection, kept idle: 1 of 2
        transfers = [_send_all(rig, conn, num_blocks=3) for _ in range(3)]
        assert wait_until(lambda: all(  # each session has taken its connection, or not
            rig.receiver.num_layers_checked(lease.lease_id) == LAYOUT.num_layers - 1
            for lease, *_ in transfers))
        for _, session, *_ in transfers:
            session.commit(timeout=10)
        for lease, _, src_kv, src_ids in transfers:
            assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
        assert (rig.local.num_connections, rig.local.num_refused) == (2, 1)
        grpc_calls = ["Begin"] + ["LayerDone"] * (LAYOUT.num_layers - 1) + ["Commit"]
        assert rig.server.servicer.calls == grpc_calls  # the refused session's, alone
        lease, session, src_kv, src_ids = _send_all(rig, conn)
        session.commit(timeout=10)
        assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
        assert rig.server.servicer.calls == grpc_calls  # an idle connection again


def test_errors_come_back_with_the_status_names_of_the_rpcs(make_rig):
    rig = make_rig("shm", LAYOUT)
    lease = rig.open(2)
    channel = LocalControlClient(rig.local.path, rig.receiver.instance_id, 5.0).take()
    cases = [
        (pb.LocalControlRequest(commit=pb.CommitRequest(lease_id="nope", layer_crc32=[0] * 4)),
         "commit", "NOT_FOUND", "nope"),
        (pb.LocalControlRequest(layer_done=pb.LayerDoneRequest(lease_id=lease.lease_id,
                                                               layer=9)),
         "layer_done", "INVALID_ARGUMENT", r"layer must be in \[0, 4\), got 9"),
        (pb.LocalControlRequest(commit=pb.CommitRequest(lease_id=lease.lease_id,
                                                        layer_crc32=[0] * 4)),
         "commit", "FAILED_PRECONDITION", "RESERVED"),  # no sender has begun
    ]
    for request, expected, code, message in cases:
        channel.send(request)
        with pytest.raises(TransferError, match=f"{code}: .*{message}") as err:
            channel.reply(expected, 5.0)
        assert err.value.code == code
    assert not channel.is_broken  # an error reply keeps the connection in step
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect(rig.local.path)
    # bytes that are no LocalControlRequest; one with no verb (an unknown field 15 only)
    for data, message in ((b"\xff\xff not a protobuf", "Error parsing message"),
                          (b"\x78\x01", "empty LocalControlRequest")):
        raw.send(data)
        reply = pb.LocalControlReply.FromString(raw.recv(MAX_CONTROL_MESSAGE_BYTES))
        assert reply.error.code == "INVALID_ARGUMENT" and message in reply.error.message
    raw.close()
    with pytest.raises(TransferError, match="FAILED_PRECONDITION.* not someone-else"):
        LocalControlClient(rig.local.path, "someone-else", 5.0).take()
    # the server keeps serving, and the lease is untouched by the refused requests
    assert rig.table.get(lease.lease_id).state is LeaseState.RESERVED
    with connect("shm", rig.target, LAYOUT) as conn:
        lease, session, src_kv, src_ids = _send_all(rig, conn)
        session.commit(timeout=10)
        assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
    channel.close()


def test_a_receiver_closing_its_socket_fails_the_session_and_frees_the_lease(make_rig):
    rig = make_rig("shm", LAYOUT)
    with connect("shm", rig.target, LAYOUT) as conn:
        lease = rig.open(4)
        src_kv, src_ids = rig.source(4)
        session = conn.begin(lease.lease_id, src_ids, list(lease.block_ids))
        for layer in range(LAYOUT.num_layers - 1):
            session.send_layer(layer, src_kv)
        assert wait_until(lambda: rig.receiver.num_layers_checked(lease.lease_id)
                          == LAYOUT.num_layers - 1)
        rig.local.close()  # drops the session's connection
        session.send_layer(LAYOUT.num_layers - 1, src_kv)
        with pytest.raises(TransferError, match="UNAVAILABLE: local control socket") as err:
            session.commit(timeout=10)
        assert err.value.code == "UNAVAILABLE"
    # the sender's Abort (over gRPC, writer stopped) released the blocks at once
    assert wait_until(lambda: len(rig.releases_of(lease.lease_id)) == 1)
    assert rig.table.get(lease.lease_id).state is LeaseState.ABORTED
    rig.local = None  # closed already


class SlowCommit(LocalControlServer):
    """Holds every Commit until `gate` opens."""

    gate = threading.Event()

    def handle(self, data: bytes):
        if pb.LocalControlRequest.FromString(data).WhichOneof("verb") == "commit":
            self.gate.wait()
        return super().handle(data)


def test_a_commit_unanswered_in_time_fails_and_frees_the_lease(make_rig):
    SlowCommit.gate = threading.Event()
    rig = make_rig("shm", LAYOUT, local_control_cls=SlowCommit)
    options = SenderOptions(rpc_timeout_s=5.0, commit_timeout_s=0.3)
    try:
        with connect("shm", rig.target, LAYOUT, options=options) as conn:
            lease, session, *_ = _send_all(rig, conn)
            with pytest.raises(TransferError, match="DEADLINE_EXCEEDED") as err:
                session.commit(timeout=5)
            assert err.value.code == "DEADLINE_EXCEEDED"
        assert wait_until(lambda: len(rig.releases_of(lease.lease_id)) == 1)
        assert rig.table.get(lease.lease_id).state is LeaseState.ABORTED
    finally:
        SlowCommit.gate.set()  # the late commit finds the lease ended; its reply has no reader


def test_control_stays_on_grpc_where_the_socket_cannot_be_reached(make_rig, caplog):
    unreachable = make_rig("shm", LAYOUT)
    unreachable.local.close()  # the handshake still names the path; nothing is there
    unreachable.local = None
    without = make_rig("shm", LAYOUT, local_control_cls=None)  # the handshake names none
    for rig, warned in ((unreachable, True), (without, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"), \
                connect("shm", rig.target, LAYOUT) as conn:
            assert conn.control == "grpc"
            lease, session, src_kv, src_ids = _send_all(rig, conn)
            session.commit(timeout=10)
            assert _claimed_bits_equal(rig, lease, src_kv, src_ids)
        messages = [r.getMessage() for r in caplog.records]
        assert any("control stays on grpc" in m and "cannot connect" in m
                   for m in messages) == warned, messages


def test_a_socket_left_by_a_dead_receiver_is_reaped_and_a_live_one_kept(make_rig):
    rig = make_rig("shm", LAYOUT, local_control_cls=None)
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="pdserve-test-")
    try:
        stale = os.path.join(directory, f"{SOCKET_PREFIX}-1-dead.sock")
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        dead.bind(stale)  # bound, never listening, closed without unlink: a killed receiver
        dead.close()
        with LocalControlServer(rig.receiver, directory) as live:  # start() reaps
            assert not os.path.exists(stale) and os.path.exists(live.path)
            assert oct(os.stat(live.path).st_mode & 0o777) == oct(0o600)
            assert reap_stale_sockets(directory) == []
        assert not os.path.exists(live.path)  # close() unlinks its own
    finally:
        shutil.rmtree(directory)


def test_a_channel_tells_whether_a_reply_is_in_without_blocking(make_rig):
    """What the sender polls before each layer's write to collect LayerDone replies."""
    rig = make_rig("shm", LAYOUT)
    channel = LocalControlClient(rig.local.path, rig.receiver.instance_id, 5.0).take()
    assert not channel.has_reply()  # nothing asked
    channel.close()
    SlowCommit.gate = threading.Event()
    rig.local.close()
    slow = SlowCommit(rig.receiver).start()  # a server whose commits wait for the gate
    rig.local = slow
    channel = LocalControlClient(slow.path, rig.receiver.instance_id, 5.0).take()
    channel.send(pb.LocalControlRequest(commit=pb.CommitRequest(lease_id="nope")))
    try:
        assert not channel.has_reply()  # held: the peek returns at once, empty-handed
    finally:
        SlowCommit.gate.set()
    assert wait_until(channel.has_reply)
    with pytest.raises(TransferError, match="NOT_FOUND"):
        channel.reply("commit", 5.0)
    assert not channel.has_reply() and not channel.is_broken
    slow.close()
    with pytest.raises(TransferError, match="UNAVAILABLE"):  # the server is gone
        channel.send(pb.LocalControlRequest(hello=True))
        channel.reply("receiver_instance", 5.0)
    assert channel.is_broken
    rig.local = None
