"""The offload tiers: byte stores of KV entries (entry.py) with a byte budget and LRU eviction.

    tier      where                          shared by
    cpu       this process's RAM             this engine (a CUDA engine's; on a CPU the pool
                                             is host RAM already)
    disk      a directory, one file a block  every process given the directory, and the
                                             next start of this one (a warm restart)
    redis     a Redis server (redis_tier.py) every host that reaches it

Every tier answers the same verbs, from any thread:

    has(keys)        which keys it holds (one round trip for the whole list)
    get(key)         the entry's bytes, or None (absent, unreadable, the store unreachable)
    put(key, parts, replace=False)
                     store an entry (its parts written one after the other), over an
                     existing one only with `replace`; False if it could not (a full disk, a
                     read-only directory, Redis down)
    discard(key)     drop an entry found corrupt
    identity()       the store's own name, the same in every process that reaches it (an id
                     the first of them wrote there), or None: private to this process, or
                     unknown now. The gateways count what one worker stored in a shared tier
                     as held by every worker whose tier has that identity.

A tier never raises for what its store does: a failure is a miss or a skipped store, counted
in `stats.errors` and logged at most once a minute (`Degraded`), and the request goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from engine_core.kv_offload.entry import pid_tag

logger = logging.getLogger(__name__)

# edges of the load and store time histograms, seconds
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class TierStats:
    """A tier's counters, read by the metrics exporter (plain ints, each consistent alone).
    hits and misses count blocks looked up; loads and stores are timed per batch (one
    request's blocks) and per block. Three threads update them (the engine's lookups, the
    load and store threads): through count() and observe_*(), under one lock."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_loaded: int = 0
    load_counts: list[int] = field(default_factory=lambda: [0] * (len(TIME_BUCKETS) + 1))
    load_seconds: float = 0.0
    store_counts: list[int] = field(default_factory=lambda: [0] * (len(TIME_BUCKETS) + 1))
    store_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            self.load_counts[_bucket(seconds)] += 1
            self.load_seconds += seconds

    def observe_store(self, seconds: float) -> None:
        with self._lock:
            self.store_counts[_bucket(seconds)] += 1
            self.store_seconds += seconds


def _bucket(seconds: float) -> int:
    return next((i for i, edge in enumerate(TIME_BUCKETS) if seconds <= edge), len(TIME_BUCKETS))


class Degraded:
    """One log line a minute for a tier that fails, however often it does."""

    def __init__(self, tier: str, period_s: float = 60.0) -> None:
        self.tier = tier
        self.period_s = period_s
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, what: str, error: BaseException) -> None:
        now = time.monotonic()
        if now - self._last < self.period_s:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more failures since the last line)" if self._suppressed else ""
        logger.warning("kv offload tier %s: %s failed, served as a miss: %s%s", self.tier, what,
                       error, more)
        self._last, self._suppressed = now, 0


class HostTier:
    """Entries in this process's memory, least recently used evicted first."""

    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def has(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
            return data

    def put(self, key: str, parts: list, replace: bool = False) -> bool:
        data = b"".join(parts)
        if len(data) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._entries and not replace:
                self._entries.move_to_end(key)
                return True
            self._entries[key] = data
            self._used += len(data)
            while self._used > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._used -= len(old)
                self.stats.count("evictions")
        return True

    def discard(self, key: str) -> None:
        with self._lock:
            data = self._entries.pop(key, None)
            if data is not None:
                self._used -= len(data)

    def identity(self) -> None:
        return None  # this process's memory: shared with no one


class DiskTier:
    """One file per entry under `root/<namespace>/<first 2 hex of the hash>/`, written to a
    temporary name and renamed into place (atomic: a reader sees the whole entry or none; a
    crash mid-write leaves a temporary file, removed at the next start). No fsync: an entry
    torn by a power loss fails its checksum and is a miss.

    The LRU index is this process's view, built at start from the files' modification times
    (a warm restart keeps the old entries, oldest evicted first) and refreshed from the
    directory at most every `rescan_s` when the budget is exceeded, so processes that share
    the directory evict each other's entries too; a hit touches the file's time. Reads go to
    the file whether or not the index knows it, so another process's entries are hits."""

    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, namespace: str,
                 rescan_s: float = 10.0) -> None:
        self.capacity_bytes = capacity_bytes
        self.dir = Path(root) / namespace
        self.stats = TierStats()
        self.rescan_s = rescan_s
        self._degraded = Degraded(self.name)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest first
        self._used = 0
        self._last_scan = 0.0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # read-only or not ours: every store fails, every lookup misses
            self._fail("creating the directory", e)
        self._scan(remove_temporaries=True)

    @property
    def used_bytes(self) -> int:
        return self._used

    def _path(self, key: str) -> Path:
        block = key.rsplit("-", 1)[1]
        return self.dir / block[:2] / f"{key}.kv"

    def _fail(self, what: str, error: BaseException) -> None:
        self.stats.count("errors")
        self._degraded(what, error)

    def _scan(self, remove_temporaries: bool = False) -> None:
        """Rebuild the index from the directory, oldest modification first."""
        found = []
        try:
            for sub in self.dir.iterdir() if self.dir.is_dir() else ():
                for f in sub.iterdir() if sub.is_dir() else ():
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue  # evicted by another process meanwhile
                    if f.suffix == ".kv":
                        found.append((st.st_mtime, f.stem, st.st_size))
                    elif remove_temporaries and time.time() - st.st_mtime > 60:
                        f.unlink(missing_ok=True)  # a write that never finished
        except OSError as e:
            self._fail("scanning the directory", e)
            return
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._used = sum(self._index.values())
            self._last_scan = time.monotonic()

    def has(self, keys: list[str]) -> list[bool]:
        with self._lock:
            known = [k in self._index for k in keys]
        return [k or self._path(key).is_file() for k, key in zip(known, keys, strict=True)]

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used -= size
            return None
        except OSError as e:
            self._fail("reading an entry", e)
            return None
        with self._lock:
            if key not in self._index:
                self._used += len(data)
            self._index[key] = len(data)
            self._index.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the next scan, this process's or another's
        return data

    def put(self, key: str, parts: list, replace: bool = False) -> bool:
        path = self._path(key)
        if not replace and path.is_file():  # ours, or another process's
            with self._lock:
                if key not in self._index:
                    with contextlib.suppress(OSError):
                        self._index[key] = path.stat().st_size
                        self._used += self._index[key]
            return True
        tmp = path.parent / f".tmp.{key}.{pid_tag()}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except OSError as e:  # a full disk, a read-only directory, a removed one
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._fail("storing an entry", e)
            return False
        size = sum(memoryview(p).nbytes for p in parts)
        with self._lock:
            if key not in self._index:
                self._used += size
            self._index[key] = size
            self._index.move_to_end(key)
            over = self._used > self.capacity_bytes
        if over:
            self._evict()
        return True

    def identity(self) -> str | None:
        """The id in the directory's `tier-id` file, written by the first process to ask
        (linked into place: every process reads the same one); None if it cannot be read or
        written."""
        path = self.dir / "tier-id"
        try:
            if not path.is_file():
                tmp = self.dir / f".tmp.tier-id.{pid_tag()}"
                tmp.write_text(uuid.uuid4().hex)
                with contextlib.suppress(FileExistsError):  # another process was first
                    os.link(tmp, path)
                tmp.unlink()
            return path.read_text().strip() or None
        except OSError as e:
            self._fail("reading the tier's id", e)
            return None

    def _evict(self) -> None:
        if time.monotonic() - self._last_scan > self.rescan_s:
            self._scan()  # count what other processes sharing the directory wrote
        while True:
            with self._lock:
                if self._used <= self.capacity_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._used -= size
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as e:
                self._fail("evicting an entry", e)
            self.stats.count("evictions")

    def discard(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            self._fail("removing a corrupt entry", e)
