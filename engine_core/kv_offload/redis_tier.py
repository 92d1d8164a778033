"""The shared remote tier: KV entries in Redis, one string value per block, for every host
that reaches the server (the Redis the stack already runs for discovery, or another).

    pdserve:kv:<namespace>:<hash>    the entry (entry.py), written with SET NX
    pdserve:kv:<namespace>:lru       sorted set: entry key -> last use (unix seconds)
    pdserve:kv:<namespace>:bytes     the namespace's bytes, kept by INCRBY / DECRBY
    pdserve:kv:<namespace>:id        the tier's identity (tiers.py), SET NX by the first asker

The byte budget is the namespace's: a store that takes it over pops the least recently used
keys from the sorted set and deletes them, whichever worker wrote them. The budget is kept by
the writers, loosely (two writers evicting at once may both evict); a server-side
`maxmemory-policy allkeys-lru` is a sound second guard, and an entry Redis dropped on its own
is a plain miss.

An unreachable or failing server is a miss or a skipped store, logged at most once a minute;
after a failure the tier stays quiet for `retry_s` (every verb returns at once) so that a
down Redis costs the scheduler nothing per request.
"""

from __future__ import annotations

import time
import uuid

import redis

from engine_core.kv_offload.tiers import Degraded, TierStats

_EVICT_BATCH = 16  # most entries one eviction round trip deletes


class RedisTier:
    name = "redis"

    def __init__(self, url: str, capacity_bytes: int, namespace: str,
                 timeout_s: float = 0.5, retry_s: float = 2.0) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self.prefix = f"pdserve:kv:{namespace}:"
        self._lru = self.prefix + "lru"
        self._bytes = self.prefix + "bytes"
        self.retry_s = retry_s
        self._quiet_until = 0.0
        self._used = 0  # as of this process's last store or eviction
        self._degraded = Degraded(self.name)

    @property
    def used_bytes(self) -> int:
        return self._used

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _call(self, what: str, fn, default):
        if time.monotonic() < self._quiet_until:
            return default
        try:
            return fn()
        except (redis.RedisError, OSError) as e:
            self.stats.count("errors")
            self._quiet_until = time.monotonic() + self.retry_s
            self._degraded(what, e)
            return default

    def has(self, keys: list[str]) -> list[bool]:
        def run():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._key(key))
            return [bool(n) for n in pipe.execute()]
        return self._call("a lookup", run, [False] * len(keys))

    def get(self, key: str) -> bytes | None:
        def run():
            pipe = self.client.pipeline(transaction=False)
            pipe.get(self._key(key))
            pipe.zadd(self._lru, {key: time.time()}, xx=True)
            return pipe.execute()[0]
        return self._call("a load", run, None)

    def put(self, key: str, parts: list, replace: bool = False) -> bool:
        data = b"".join(parts)
        if len(data) > self.capacity_bytes:
            return False

        def run():
            if replace:
                self.discard(key)
            if not self.client.set(self._key(key), data, nx=True):
                self.client.zadd(self._lru, {key: time.time()}, xx=True)
                return True  # another worker stored it first
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(self._lru, {key: time.time()})
            pipe.incrby(self._bytes, len(data))
            self._used = pipe.execute()[1]
            while self._used > self.capacity_bytes:
                # about as many as the excess, in entries of this one's size
                n = min(-(-(self._used - self.capacity_bytes) // len(data)), _EVICT_BATCH)
                if not self._evict_some(n):
                    break
            return True
        return self._call("a store", run, False)

    def _evict_some(self, n: int) -> bool:
        """Delete the n least recently used; False when there is nothing left to evict."""
        popped = self.client.zpopmin(self._lru, n)
        if not popped:
            self.client.set(self._bytes, 0)  # the count drifted (entries Redis dropped)
            self._used = 0
            return False
        names = [self._key(k.decode() if isinstance(k, bytes) else k) for k, _ in popped]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
        sizes = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(*names)
        pipe.decrby(self._bytes, sum(sizes))
        self._used = pipe.execute()[1]
        self.stats.count("evictions", sum(1 for s in sizes if s))
        return True

    def identity(self) -> str | None:
        def run():
            self.client.set(self.prefix + "id", uuid.uuid4().hex, nx=True)
            got = self.client.get(self.prefix + "id")
            return got.decode() if got else None
        return self._call("reading the tier's id", run, None)

    def discard(self, key: str) -> None:
        def run():
            size = self.client.strlen(self._key(key))
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self._key(key))
            pipe.zrem(self._lru, key)
            pipe.decrby(self._bytes, size)
            pipe.execute()
        self._call("removing a corrupt entry", run, None)

    def close(self) -> None:
        self.client.close()
