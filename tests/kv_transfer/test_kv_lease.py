"""The lease table as a pure state machine: a fake clock, exact states, exactly-once releases."""

from __future__ import annotations

import random
import subprocess
import threading
import time

import pytest

from kv_transfer import LeaseEndedError, LeaseError, LeaseState, LeaseTable, UnknownLeaseError
from kv_transfer.process import is_running, my_identity, start_ticks
from tests.threads import CheckedThread, join_checked


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def released() -> list:
    return []


@pytest.fixture
def table(clock, released) -> LeaseTable:
    return LeaseTable(lambda lease, reason: released.append((lease.lease_id, lease.state, reason)),
                      claim_ttl_s=5.0, clock=clock)


def deliver(table: LeaseTable, lease_id: str, num_layers: int = 2, one_sided=False) -> None:
    lease = table.get(lease_id)
    table.begin(lease_id, lease.block_ids, "shm" if one_sided else "grpc", one_sided)
    for layer in range(num_layers):
        table.record_layer(lease_id, layer, crc32=layer + 7)
    table.start_verify(lease_id)


def test_happy_path_claims_without_release(table, released):
    lease = table.open("r1", [7, 3, 9], ttl_s=10)
    assert lease.state is LeaseState.RESERVED and lease.block_ids == (7, 3, 9)
    deliver(table, lease.lease_id)
    assert table.get(lease.lease_id).layer_crc32 == ((0, 7), (1, 8))
    assert table.complete(lease.lease_id, ok=True).state is LeaseState.COMPLETE
    assert table.claim(lease.lease_id) == [7, 3, 9]
    assert released == [] and table.num_blocks_held == 0
    assert table.get(lease.lease_id).state is LeaseState.CLAIMED
    assert table.num_ended == {"CLAIMED": 1}
    with pytest.raises(LeaseEndedError, match="CLAIMED"):
        table.claim(lease.lease_id)
    table.check_integrity()


def test_withdraw_hands_a_reserved_lease_to_a_local_prefill_without_release(table, released):
    lease = table.open("r1", [4, 5], ttl_s=10)
    assert table.withdraw(lease.lease_id) == [4, 5]
    assert released == [] and table.num_blocks_held == 0
    assert table.get(lease.lease_id).state is LeaseState.CLAIMED
    assert table.abort(lease.lease_id, "late") is False and released == []
    with pytest.raises(LeaseEndedError, match="CLAIMED"):
        table.withdraw(lease.lease_id)
    # once a sender has begun, the blocks are being written: no local prefill
    begun = table.open("r2", [6], ttl_s=10)
    table.begin(begun.lease_id, [6], "grpc", is_one_sided=False)
    with pytest.raises(LeaseError, match="RECEIVING, needs RESERVED"):
        table.withdraw(begun.lease_id)
    table.check_integrity()


def test_abort_releases_exactly_once(table, released):
    lease = table.open("r1", [1, 2], ttl_s=10)
    assert table.abort(lease.lease_id, "client cancelled") is True
    assert table.abort(lease.lease_id, "again") is False
    assert table.abort("no-such-lease", "x") is False
    assert released == [(lease.lease_id, LeaseState.ABORTED, "client cancelled")]
    with pytest.raises(LeaseEndedError, match="ABORTED: client cancelled"):
        table.begin(lease.lease_id, [1, 2], "grpc", False)
    table.check_integrity()


@pytest.mark.parametrize("progress", ["reserved", "receiving", "complete"])
def test_expiry_in_every_live_state(table, clock, released, progress):
    lease = table.open("r1", [4, 5], ttl_s=10)
    if progress != "reserved":
        table.begin(lease.lease_id, [4, 5], "grpc", False)
    if progress == "complete":
        table.record_layer(lease.lease_id, 0, 1)
        table.start_verify(lease.lease_id)
        table.complete(lease.lease_id, ok=True)  # fresh deadline: now + claim_ttl_s (5)
    clock.now += 4.9
    assert table.expire_due() == []
    clock.now += 5.2
    assert [x.lease_id for x in table.expire_due()] == [lease.lease_id]
    assert table.expire_due() == []
    assert len(released) == 1 and released[0][1] is LeaseState.EXPIRED
    assert table.num_blocks_held == 0
    table.check_integrity()


def test_verbs_expire_overdue_leases_without_the_reaper(table, clock, released):
    lease = table.open("r1", [4, 5], ttl_s=1)
    clock.now += 1.0
    with pytest.raises(LeaseEndedError, match="EXPIRED"):
        table.begin(lease.lease_id, [4, 5], "grpc", False)
    assert [state for _, state, _ in released] == [LeaseState.EXPIRED]


def test_failed_verification_releases_and_is_never_claimable(table, released):
    lease = table.open("r1", [4, 5], ttl_s=10)
    deliver(table, lease.lease_id)
    table.complete(lease.lease_id, ok=False, reason="layer 1 crc mismatch")
    assert released == [(lease.lease_id, LeaseState.FAILED, "layer 1 crc mismatch")]
    with pytest.raises(LeaseEndedError, match="FAILED"):
        table.claim(lease.lease_id)


def test_verbs_refuse_wrong_states_and_bad_arguments(table):
    lease = table.open("r1", [4, 5], ttl_s=10)
    with pytest.raises(LeaseError, match="needs COMPLETE"):
        table.claim(lease.lease_id)
    with pytest.raises(LeaseError, match="not the lease's blocks"):
        table.begin(lease.lease_id, [5, 4], "grpc", False)  # same blocks, other order
    table.begin(lease.lease_id, [4, 5], "grpc", False)
    with pytest.raises(LeaseError, match="needs RESERVED"):
        table.begin(lease.lease_id, [4, 5], "grpc", False)  # a second sender
    table.record_layer(lease.lease_id, 0, 1)
    with pytest.raises(LeaseError, match="twice"):
        table.record_layer(lease.lease_id, 0, 1)
    with pytest.raises(ValueError, match="already leased"):
        table.open("r2", [9, 5], ttl_s=10)
    with pytest.raises(ValueError, match="distinct"):
        table.open("r2", [8, 8], ttl_s=10)
    with pytest.raises(UnknownLeaseError):
        table.renew("nope", 1)


def test_renew_only_extends(table, clock):
    lease = table.open("r1", [1], ttl_s=10)
    assert table.renew(lease.lease_id, 30).deadline == clock.now + 30
    assert table.renew(lease.lease_id, 1).deadline == clock.now + 30


def test_renew_keeps_a_queued_lease_alive_but_not_a_stalled_transfer(table, clock, released):
    """A RESERVED lease renewed before each deadline outlives its ttl many times over; once a
    sender has begun, renewal restricted to RESERVED is refused and the deadline stands."""
    lease = table.open("r1", [1, 2], ttl_s=10)
    for _ in range(5):  # 45 s in the prefill queue, renewed every 9 s
        clock.now += 9
        table.renew(lease.lease_id, 10, required=LeaseState.RESERVED)
    assert table.expire_due() == [] and table.get(lease.lease_id).state is LeaseState.RESERVED
    clock.now += 9  # the transfer begins 1 s before the renewed deadline: it gets a full ttl
    table.begin(lease.lease_id, [1, 2], "grpc", False)
    assert table.get(lease.lease_id).deadline == clock.now + 10
    with pytest.raises(LeaseError, match="needs RESERVED"):
        table.renew(lease.lease_id, 10, required=LeaseState.RESERVED)
    for layer in range(3):  # a long prefill step: each layer arrives 9 s after the previous
        clock.now += 9
        assert table.record_layer(lease.lease_id, layer, 1).deadline == clock.now + 10
    clock.now += 10  # then the transfer stalls for a ttl
    assert [x.state for x in table.expire_due()] == [LeaseState.EXPIRED]
    assert released[0][1] is LeaseState.EXPIRED and table.num_blocks_held == 0
    with pytest.raises(LeaseEndedError, match="EXPIRED"):
        table.renew(lease.lease_id, 10)
    with pytest.raises(ValueError, match="ttl_s"):
        table.renew(table.open("r2", [3], ttl_s=1).lease_id, 0)
    table.check_integrity()


def test_writing_checks_blocks_and_counts_bytes(table):
    lease = table.open("r1", [1, 2, 3], ttl_s=10)
    with pytest.raises(LeaseError, match="needs RECEIVING"), table.writing(lease.lease_id, [1], 8):
        pass
    table.begin(lease.lease_id, [1, 2, 3], "grpc", False)
    with table.writing(lease.lease_id, [3, 1], 100):
        pass
    with pytest.raises(LeaseError, match=r"blocks \[4\]"), table.writing(lease.lease_id, [4], 8):
        pass
    assert table.get(lease.lease_id).num_bytes_received == 100


def test_abort_waits_for_a_write_in_progress(table, released):
    """The release (after which the blocks may be reused) never overlaps a write."""
    lease = table.open("r1", [1, 2], ttl_s=10)
    table.begin(lease.lease_id, [1, 2], "grpc", False)
    events = []
    in_write = threading.Event()

    def writer():
        with table.writing(lease.lease_id, [1], 8):
            in_write.set()
            time.sleep(0.05)
            events.append("write done")

    t = CheckedThread(writer)
    t.start()
    assert in_write.wait(10), t.error
    table.abort(lease.lease_id, "cancel")
    events.append("released" if released else "not released")
    join_checked([t], timeout_s=10)
    assert events == ["write done", "released"]


def test_one_sided_abort_keeps_blocks_until_the_writer_acknowledges(table, released, clock):
    lease = table.open("r1", [1, 2], ttl_s=10)
    table.begin(lease.lease_id, [1, 2], "shm", is_one_sided=True)
    assert table.abort(lease.lease_id, "decode cancelled") is True
    assert released == [] and table.num_blocks_held == 2  # the sender may be mid-copy
    assert table.get(lease.lease_id).state is LeaseState.ABORTED
    with pytest.raises(LeaseEndedError):
        table.record_layer(lease.lease_id, 0, 1)
    table.check_integrity()
    assert table.abort(lease.lease_id, "ack", writer_stopped=True) is False
    assert released == [(lease.lease_id, LeaseState.ABORTED, "decode cancelled")]
    assert table.num_blocks_held == 0
    table.check_integrity()


def test_one_sided_abort_without_ack_releases_at_the_deadline(table, released, clock):
    lease = table.open("r1", [1, 2], ttl_s=10)
    table.begin(lease.lease_id, [1, 2], "shm", is_one_sided=True)
    table.abort(lease.lease_id, "decode cancelled")
    clock.now += 9.9
    assert table.expire_due() == [] and released == []
    clock.now += 0.1
    assert len(table.expire_due()) == 1
    assert released == [(lease.lease_id, LeaseState.ABORTED, "decode cancelled")]


def test_one_sided_writer_frozen_past_the_deadline_keeps_its_blocks(clock):
    """A sender frozen (SIGSTOP) mid-copy would finish that copy on resuming: while its process
    runs, the blocks stay held past the deadline; its exit or its ack releases them."""
    released, running = [], {(4242, 77)}
    table = LeaseTable(lambda lease, reason: released.append(lease.state), clock=clock,
                       is_running=lambda pid, ticks: (pid, ticks) in running)
    frozen = table.open("r1", [1, 2], ttl_s=10)
    table.begin(frozen.lease_id, [1, 2], "shm", is_one_sided=True, writer=(4242, 77))
    acked = table.open("r2", [3], ttl_s=10)
    table.begin(acked.lease_id, [3], "shm", is_one_sided=True, writer=(4242, 77))
    clock.now += 60  # far past both deadlines: expired, but the writer process still runs
    assert table.expire_due() == [] and released == []
    assert table.num_blocks_held == 3
    with pytest.raises(LeaseEndedError, match="EXPIRED"):
        table.record_layer(frozen.lease_id, 0, 1)  # no verb revives it
    table.abort(acked.lease_id, "sender stopped", writer_stopped=True)  # its ack
    assert released == [LeaseState.EXPIRED] and table.num_blocks_held == 2
    running.clear()  # the frozen sender exits (killed, or it resumed and ended)
    assert [x.lease_id for x in table.expire_due()] == [frozen.lease_id]
    assert table.num_blocks_held == 0
    table.check_integrity()


def test_one_sided_writer_killed_releases_before_the_deadline(clock):
    """kill -9 of a sender mid-copy: it can write no more, so its aborted lease's blocks go
    back at the next reap, not a whole ttl later; a writer never seen running here (another
    pid namespace) cannot be watched, and its blocks wait for the deadline."""
    released, running = [], {(4242, 77)}
    table = LeaseTable(lambda lease, reason: released.append((lease.req_id, lease.state)),
                       clock=clock, is_running=lambda pid, ticks: (pid, ticks) in running)
    killed = table.open("killed", [1, 2], ttl_s=30)
    table.begin(killed.lease_id, [1, 2], "shm", is_one_sided=True, writer=(4242, 77))
    unseen = table.open("unseen", [3], ttl_s=30)
    table.begin(unseen.lease_id, [3], "shm", is_one_sided=True, writer=(999, 5))
    assert table.get(unseen.lease_id).writer == (0, 0)
    table.abort(killed.lease_id, "prefill worker lost")
    table.abort(unseen.lease_id, "prefill worker lost")
    assert table.expire_due() == [] and table.num_blocks_held == 3  # 4242 still runs
    running.clear()  # kill -9 of the sender
    clock.now += 0.1
    assert [x.req_id for x in table.expire_due()] == ["killed"]
    assert released == [("killed", LeaseState.ABORTED)] and table.num_blocks_held == 1
    clock.now += 30
    assert [x.req_id for x in table.expire_due()] == ["unseen"]
    assert table.num_blocks_held == 0
    table.check_integrity()


def test_process_identity_of_real_processes():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        ticks = start_ticks(proc.pid)
        assert ticks > 0 and is_running(proc.pid, ticks)
        assert not is_running(proc.pid, ticks + 1)  # another process under a reused pid
        assert is_running(*my_identity())
    finally:
        proc.kill()
        proc.wait()
    assert not is_running(proc.pid, ticks) and not is_running(0, 0)


def test_a_failing_release_callback_does_not_break_the_table(clock):
    def explode(lease, reason):
        raise RuntimeError("boom")

    table = LeaseTable(explode, clock=clock)
    lease = table.open("r1", [1], ttl_s=10)
    assert table.abort(lease.lease_id, "x") is True
    table.check_integrity()


def test_check_integrity_names_the_disagreeing_numbers(table):
    lease = table.open("r1", [1, 2], ttl_s=10)
    del table._block_owner[2]  # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match=f"lease {lease.lease_id} holds 2 blocks.*gives it 1"):
        table.check_integrity()


def test_concurrent_verbs_release_each_lease_at_most_once(seed):
    released = []
    table = LeaseTable(lambda lease, reason: released.append(lease.lease_id), claim_ttl_s=0.2)
    leases = [table.open(f"r{i}", [2 * i, 2 * i + 1], ttl_s=0.05 + 0.001 * (i % 20))
              for i in range(200)]
    claimed = []

    def worker(k: int) -> None:
        rng = random.Random(seed + k)
        for lease in rng.sample(leases, len(leases)):
            try:
                verb = rng.choice(["abort", "expire", "deliver", "claim"])
                if verb == "abort":
                    table.abort(lease.lease_id, "x", writer_stopped=rng.random() < 0.5)
                elif verb == "expire":
                    table.expire_due()
                elif verb == "deliver":
                    deliver(table, lease.lease_id, num_layers=1, one_sided=rng.random() < 0.5)
                    table.complete(lease.lease_id, ok=rng.random() < 0.8)
                else:
                    claimed.extend([lease.lease_id] * bool(table.claim(lease.lease_id)))
            except LeaseError:
                pass

    threads = [CheckedThread(worker, k) for k in range(6)]
    for t in threads:
        t.start()
    join_checked(threads, timeout_s=60)  # anything but a LeaseError fails the test
    time.sleep(0.25)  # past every deadline, including the claim ttl
    table.expire_due()
    table.check_integrity()
    assert len(released) == len(set(released)), "a lease was released twice"
    assert sorted(released + claimed) == sorted(lease.lease_id for lease in leases)
    assert table.num_blocks_held == 0
