"""Leases on reserved decode KV blocks: the receiver's half of the transactional handoff.

A lease covers the destination blocks of one request from the moment the decode worker
reserves them until the decode scheduler claims them (verified KV) or they are released.

    open -> RESERVED -begin-> RECEIVING -commit-> VERIFYING -ok-> COMPLETE -claim-> CLAIMED
               |                  |                  |  \\             |
               |                  |                  |   `-bad-> FAILED
               `------------------+------------------+-------------+--> ABORTED | EXPIRED
                                      abort (either side) / deadline passed

Invariants (check_integrity() asserts the ones that are state):
- Every lease reaches exactly one terminal state: CLAIMED, FAILED, ABORTED or EXPIRED.
- on_release(lease, reason) runs exactly once for every lease that ends other than CLAIMED,
  from the thread that ended it, after the table lock is dropped. The decode service frees
  the blocks there, so it must be quick and thread-safe (e.g. hand the ids to the engine).
- Bytes are written into a lease's blocks only while it is RECEIVING. Two-sided writes (grpc)
  happen inside `writing()`, under the table lock, so a lease cannot end in mid-write.
- A one-sided lease (shm, cuda_ipc: the sender writes into the pool itself) that is aborted
  while its sender may still be writing keeps its blocks until the sender acknowledges
  (abort with writer_stopped=True) or its process (pid + start time, kv_transfer/process.py,
  seen running at begin) no longer runs: a killed sender's blocks go back within one reap,
  not at the deadline. A sender this host cannot see (no /proc, another pid namespace) is
  trusted to stop a margin before the deadline (session.py): its blocks wait for the
  deadline. A frozen sender would finish its copy on resuming, so a running one keeps its
  blocks past the deadline. Deadlines are only ever extended.
- No block belongs to two leases that still hold blocks.
- A lease past its deadline is EXPIRED for every verb, whether or not expire_due() ran.
  Deadlines follow progress: RESERVED gets ttl_s from open and from each renew() (the gateway
  renews while the prompt is queued for prefill); begin() and every layer recorded give the
  transfer ttl_s from then. So a lease expires after ttl_s without news, however long the
  queue or the prefill step (the layers of one step arrive as it computes them).
  A COMPLETE lease gets a fresh deadline (claim_ttl_s) and expires too if never claimed.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from kv_transfer.errors import LeaseEndedError, LeaseError, UnknownLeaseError
from kv_transfer.process import is_running

log = logging.getLogger("pdserve.kv_transfer")


class LeaseState(enum.Enum):
    RESERVED = "RESERVED"  # blocks reserved, no sender yet
    RECEIVING = "RECEIVING"  # a sender has begun; layers arrive
    VERIFYING = "VERIFYING"  # commit received, checksums being verified; no more writes
    COMPLETE = "COMPLETE"  # verified; waiting for the decode scheduler to claim it
    CLAIMED = "CLAIMED"  # handed to the decode scheduler, blocks kept (terminal)
    FAILED = "FAILED"  # verification failed; released (terminal)
    ABORTED = "ABORTED"  # aborted by either side; released (terminal)
    EXPIRED = "EXPIRED"  # deadline passed; released (terminal)

    @property
    def is_terminal(self) -> bool:
        return self in (LeaseState.CLAIMED, LeaseState.FAILED, LeaseState.ABORTED,
                        LeaseState.EXPIRED)


@dataclass(frozen=True)
class Lease:
    """A snapshot of one lease; the table replaces it on every transition."""

    lease_id: str
    req_id: str
    block_ids: tuple[int, ...]  # destination blocks, in the order the sender ships them
    deadline: float  # table clock (time.monotonic), seconds; expired when now >= deadline
    ttl_s: float = 0.0  # as opened: each phase (queued, transferring) gets this long
    state: LeaseState = LeaseState.RESERVED
    transport: str = ""  # the transport's name (transports/) once a sender has begun
    is_one_sided: bool = False  # the sender writes into the pool directly (shm, cuda_ipc)
    is_writer_active: bool = False  # a one-sided sender may be writing right now
    writer: tuple[int, int] = (0, 0)  # one-sided sender's (pid, start ticks); (0, 0): unknown
    layer_crc32: tuple[tuple[int, int], ...] = ()  # (layer, crc32) as announced by LayerDone
    num_bytes_received: int = 0  # two-sided only: payload bytes written, all layers
    reason: str = ""  # why it ended (terminal states)

    @property
    def num_layers_received(self) -> int:
        return len(self.layer_crc32)


ReleaseCallback = Callable[[Lease, str], None]


class LeaseTable:
    """Thread-safe table of the leases of one decode worker (grpc.aio thread + engine thread)."""

    def __init__(self, on_release: ReleaseCallback, *, claim_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_remembered: int = 4096,
                 is_running: Callable[[int, int], bool] = is_running):
        if claim_ttl_s <= 0:
            raise ValueError(f"claim_ttl_s must be > 0, got {claim_ttl_s}")
        self._on_release = on_release
        self._claim_ttl_s = claim_ttl_s
        self._clock = clock
        self._is_running = is_running  # (pid, start ticks) -> whether that process still runs
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}  # every lease that still holds its blocks
        self._block_owner: dict[int, str] = {}  # block id -> lease id, over self._leases
        self._ended: OrderedDict[str, Lease] = OrderedDict()  # recently ended, for errors
        self._max_remembered = max_remembered
        self._released: list[Lease] = []  # releases queued by the verb holding the lock
        self.num_opened = 0
        self.num_ended: Counter[str] = Counter()  # terminal state name -> leases retired

    # -- queries ---------------------------------------------------------------------------
    def now(self) -> float:
        """The table's clock (the time base of every deadline), seconds."""
        return self._clock()

    def get(self, lease_id: str) -> Lease | None:
        """The lease (held or recently ended) without side effects, or None if unknown."""
        with self._lock:
            return self._leases.get(lease_id) or self._ended.get(lease_id)

    def leases(self) -> list[Lease]:
        """Every lease that still holds its blocks."""
        with self._lock:
            return list(self._leases.values())

    @property
    def num_blocks_held(self) -> int:
        with self._lock:
            return len(self._block_owner)

    # -- verbs -----------------------------------------------------------------------------
    def open(self, req_id: str, block_ids: Sequence[int], ttl_s: float) -> Lease:
        """Reserve `block_ids` (already allocated by the decode worker) for one transfer."""
        ids = tuple(int(b) for b in block_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"block_ids must be distinct non-negative ids, got {list(ids)}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self._lock:
            taken = {b: self._block_owner[b] for b in ids if b in self._block_owner}
            if taken:
                raise ValueError(f"blocks already leased: {taken}")
            lease = Lease(uuid.uuid4().hex, req_id, ids, self._clock() + ttl_s, ttl_s)
            self._leases[lease.lease_id] = lease
            self._block_owner.update(dict.fromkeys(ids, lease.lease_id))
            self.num_opened += 1
            return lease

    def renew(self, lease_id: str, ttl_s: float,
              required: LeaseState | None = None) -> Lease:
        """Extend a live lease (in state `required`, if given) to at least now + ttl_s;
        deadlines never move earlier. The gateway renews RESERVED leases while the prompt
        waits in a prefill queue; once a sender has begun, the deadline bounds the transfer."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self._transition(lease_id, required) as (lease, now):
            return self._put(replace(lease, deadline=max(lease.deadline, now + ttl_s)))

    def begin(self, lease_id: str, block_ids: Sequence[int], transport: str,
              is_one_sided: bool, writer: tuple[int, int] = (0, 0)) -> Lease:
        """A sender arrives: RESERVED -> RECEIVING. Its destination blocks must be the lease's.
        The transfer gets the lease's full ttl from now (however long the queue was)."""
        with self._transition(lease_id, LeaseState.RESERVED) as (lease, now):
            if tuple(block_ids) != lease.block_ids:
                raise LeaseError(lease_id, f"destination blocks {list(block_ids)} are not the "
                                           f"lease's blocks {list(lease.block_ids)}")
            # a writer named but not seen running here cannot be watched: the deadline rules
            seen = is_one_sided and self._is_running(*writer)
            return self._put(replace(lease, state=LeaseState.RECEIVING, transport=transport,
                                     is_one_sided=is_one_sided, is_writer_active=is_one_sided,
                                     writer=writer if seen else (0, 0),
                                     deadline=max(lease.deadline, now + lease.ttl_s)))

    @contextmanager
    def writing(self, lease_id: str, block_ids: Sequence[int], nbytes: int) -> Iterator[Lease]:
        """Hold a RECEIVING two-sided lease for one write into `block_ids` (a subset of its
        blocks): the lease cannot end until the with-block exits. Keep the block short."""
        with self._transition(lease_id, LeaseState.RECEIVING) as (lease, _):
            if lease.is_one_sided:
                raise LeaseError(lease_id, f"{lease.transport} lease takes no pushed bytes")
            stray = set(block_ids).difference(lease.block_ids)
            if stray:
                raise LeaseError(lease_id, f"blocks {sorted(stray)} are not in the lease")
            yield lease
            self._put(replace(lease, num_bytes_received=lease.num_bytes_received + nbytes))

    def record_layer(self, lease_id: str, layer: int, crc32: int) -> Lease:
        """One layer has fully arrived, with the sender's checksum of it. Progress: the lease
        gets its ttl again from now (a transfer expires after ttl_s without a layer)."""
        with self._transition(lease_id, LeaseState.RECEIVING) as (lease, now):
            if any(seen == layer for seen, _ in lease.layer_crc32):
                raise LeaseError(lease_id, f"layer {layer} reported done twice")
            crcs = tuple(sorted((*lease.layer_crc32, (layer, crc32))))
            return self._put(replace(lease, layer_crc32=crcs,
                                     deadline=max(lease.deadline, now + lease.ttl_s)))

    def start_verify(self, lease_id: str) -> Lease:
        """The sender committed (so it writes no more): RECEIVING -> VERIFYING."""
        with self._transition(lease_id, LeaseState.RECEIVING) as (lease, _):
            return self._put(replace(lease, state=LeaseState.VERIFYING, is_writer_active=False))

    def complete(self, lease_id: str, ok: bool, reason: str = "") -> Lease:
        """Verification done: VERIFYING -> COMPLETE (claimable until claim_ttl_s passes), or
        FAILED (released)."""
        with self._transition(lease_id, LeaseState.VERIFYING) as (lease, now):
            if ok:
                return self._put(replace(lease, state=LeaseState.COMPLETE,
                                         deadline=now + self._claim_ttl_s))
            return self._end(lease, LeaseState.FAILED, reason, now)

    def abort(self, lease_id: str, reason: str, *, writer_stopped: bool = False) -> bool:
        """End the lease (ABORTED) unless it has ended already; True if this call ended it.
        `writer_stopped`: the one-sided sender guarantees it writes no more (it is the caller,
        or acknowledges), so the blocks may be released now rather than at the deadline."""
        with self._locked() as now:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            if lease.state.is_terminal:  # aborted earlier, release deferred for the writer
                if writer_stopped or not self._may_write(lease, now):
                    self._retire(lease)
                return False
            if now >= lease.deadline:
                self._end(lease, LeaseState.EXPIRED, self._expiry_reason(lease), now)
                return False
            if writer_stopped:
                lease = replace(lease, is_writer_active=False)
            self._end(lease, LeaseState.ABORTED, reason, now)
            return True

    def expire_due(self, now: float | None = None) -> list[Lease]:
        """Expire every lease whose deadline has passed and release the ended ones whose
        writer can no longer write (its deadline passed, or its process exited); returns the
        leases released."""
        with self._locked(now) as now:
            for lease in list(self._leases.values()):
                if not lease.state.is_terminal:
                    if now >= lease.deadline:
                        self._end(lease, LeaseState.EXPIRED, self._expiry_reason(lease), now)
                elif not self._may_write(lease, now):
                    self._retire(lease)
            return list(self._released)

    def claim(self, lease_id: str) -> list[int]:
        """Hand the blocks of a COMPLETE lease to the decode scheduler: the lease ends
        (CLAIMED) without on_release; the scheduler now owns the blocks."""
        with self._transition(lease_id, LeaseState.COMPLETE) as (lease, now):
            self._end(lease, LeaseState.CLAIMED, "claimed", now)
            return list(lease.block_ids)

    def withdraw(self, lease_id: str) -> list[int]:
        """The decode worker computes the prompt itself (a local prefill): a RESERVED lease,
        into which no sender has begun writing, ends CLAIMED without on_release; the
        scheduler keeps the blocks. LeaseError once a transfer has begun."""
        with self._transition(lease_id, LeaseState.RESERVED) as (lease, now):
            self._end(lease, LeaseState.CLAIMED, "prefilled locally", now)
            return list(lease.block_ids)

    # -- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError naming the disagreeing numbers if an invariant is broken."""
        with self._lock:
            owners = Counter(self._block_owner.values())
            for lease in self._leases.values():
                held = owners.get(lease.lease_id, 0)
                assert held == len(lease.block_ids), (
                    f"lease {lease.lease_id} holds {len(lease.block_ids)} blocks, "
                    f"the owner map gives it {held}")
                assert not lease.state.is_terminal or lease.is_writer_active, (
                    f"lease {lease.lease_id} is {lease.state.name} but still holds blocks "
                    f"without an active writer")
            assert sum(owners.values()) == len(self._block_owner)
            assert set(owners) <= set(self._leases), (
                f"owner map names leases not in the table: {set(owners) - set(self._leases)}")
            num_retired = sum(self.num_ended.values())
            assert self.num_opened == len(self._leases) + num_retired, (
                f"opened {self.num_opened} != held {len(self._leases)} + ended {num_retired}")

    # -- internals -------------------------------------------------------------------------
    @contextmanager
    def _locked(self, now: float | None = None) -> Iterator[float]:
        """Run under the lock; fire the releases it queued once the lock is dropped."""
        released: list[Lease] = []  # published to _retire() only while the lock is held
        try:
            with self._lock:
                self._released = released
                yield self._clock() if now is None else now
        finally:
            for lease in released:
                try:
                    self._on_release(lease, lease.reason)
                except Exception:
                    log.exception("on_release failed for lease %s", lease.lease_id)

    @contextmanager
    def _transition(self, lease_id: str,
                    required: LeaseState | None = None) -> Iterator[tuple[Lease, float]]:
        """Under the lock: the lease if it is live (and in `required`), else LeaseError.
        A lease found past its deadline is expired on the spot."""
        with self._locked() as now:
            lease = self._leases.get(lease_id)
            if lease is None:
                ended = self._ended.get(lease_id)
                if ended is None:
                    raise UnknownLeaseError(lease_id, "unknown lease")
                raise LeaseEndedError(lease_id, ended.state.name, ended.reason)
            if not lease.state.is_terminal and now >= lease.deadline:
                lease = self._end(lease, LeaseState.EXPIRED, self._expiry_reason(lease), now)
            elif lease.state.is_terminal and not self._may_write(lease, now):
                self._retire(lease)
            if lease.state.is_terminal:
                raise LeaseEndedError(lease_id, lease.state.name, lease.reason)
            if required is not None and lease.state is not required:
                raise LeaseError(lease_id, f"is {lease.state.name}, needs {required.name}")
            yield lease, now

    def _put(self, lease: Lease) -> Lease:
        self._leases[lease.lease_id] = lease
        return lease

    def _end(self, lease: Lease, state: LeaseState, reason: str, now: float) -> Lease:
        """Move a held lease to a terminal state; its blocks go unless a one-sided writer
        may still be writing into them before the deadline."""
        lease = replace(lease, state=state, reason=reason)
        if self._may_write(lease, now):
            return self._put(lease)  # released on the writer's ack, its exit or the deadline
        self._retire(lease)
        return lease

    def _retire(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        for b in lease.block_ids:
            del self._block_owner[b]
        self._ended[lease.lease_id] = lease
        while len(self._ended) > self._max_remembered:
            self._ended.popitem(last=False)
        self.num_ended[lease.state.name] += 1
        if lease.state is not LeaseState.CLAIMED:
            self._released.append(lease)

    def _may_write(self, lease: Lease, now: float) -> bool:
        """Whether a one-sided sender may still write into the lease's blocks: it has not
        said it stopped, and its process still runs (seen at begin: a dead one writes
        nothing, a frozen one past the deadline would finish its copy on resuming) or, when
        this host cannot see it, the deadline (which it stops writing before) has not passed."""
        if not lease.is_writer_active:
            return False
        if lease.writer != (0, 0):
            return self._is_running(*lease.writer)
        return now < lease.deadline

    @staticmethod
    def _expiry_reason(lease: Lease) -> str:
        if lease.state is LeaseState.COMPLETE:
            return "complete but never claimed before the deadline"
        return f"deadline passed while {lease.state.name} " \
               f"({lease.num_layers_received} layers received)"
