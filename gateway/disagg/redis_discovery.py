"""The gateway's view of the workers registered in Redis (the key schema and its config:
service_infra/redis_registry.py; the workers' side: service_infra/worker_registration.py).

The gateway: SCAN + pipelined HGETALL per refresh (once a second); per routed prompt one
pipelined ZMSCORE per candidate prefill worker (one round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis

from gateway.disagg.discovery import WorkerAddress
from service_infra.redis_registry import REDIS_ERRORS, OutageLog, RedisConfig, block_member

logger = logging.getLogger(__name__)
PREFIX_QUERY_TIMEOUT_S = 0.25  # routing waits this long for prefix information at most
# a worker whose entry does not say its registration ttl (an older release) re-registers
# within the default ttl (--registration-ttl)
DEFAULT_REGISTRATION_TTL_S = 10.0


class RedisDiscovery:
    """The gateway's Discovery (gateway/disagg/discovery.py) over the registered workers, and which
    prefill workers hold a prompt's leading blocks. While Redis is down, workers() answers
    what it last saw and prefix_overlap() None (routing by queue depth); each outage is
    logged once.

    After an outage, a worker known before it and missing now is kept for its registration
    ttl from the moment Redis answers again: an outage longer than the ttl lets every entry
    expire in Redis (nobody could heartbeat), and the workers write them back within a third
    of their ttl. Without this grace the gateway would drop every worker for that moment and
    refuse requests (readiness NOT_SERVING) although all of them serve."""

    def __init__(self, config: RedisConfig, client: aioredis.Redis) -> None:
        self.config = config
        self._redis = client
        self._last: list[WorkerAddress] = []
        self._is_down = False
        self._back_at: float | None = None  # time.monotonic() Redis answered after an outage
        self._bad_keys: set[str] = set()  # malformed entries, warned about once
        self._workers_outage = OutageLog("discovery")
        self._prefix_outage = OutageLog("prefix routing (routing by queue depth meanwhile)")

    @classmethod
    async def connect(cls, config: RedisConfig) -> RedisDiscovery:
        return cls(config, await config.connect())

    async def workers(self) -> list[WorkerAddress]:
        try:
            keys = [k async for k in self._redis.scan_iter(
                match=f"{self.config.namespace}:worker:*", count=1000)]
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
            rows = await pipe.execute() if keys else []
            self._workers_outage.ok()
        except REDIS_ERRORS as e:
            self._workers_outage.failed(f"keeping the last known workers: "
                                        f"{self.config.describe(e)}")
            self._is_down, self._back_at = True, None
            return list(self._last)
        if self._is_down:
            self._is_down, self._back_at = False, time.monotonic()
        newest: dict[str, tuple[float, WorkerAddress]] = {}  # address -> its newest entry
        for key, row in zip(keys, rows, strict=True):
            if not row:  # expired between SCAN and HGETALL
                continue
            try:
                w = WorkerAddress(row["role"], row["address"], worker_id=row["worker_id"],
                                  model=row["model"], layout_fingerprint=row["layout_fingerprint"],
                                  epoch=int(row["epoch"]), num_blocks=int(row["num_blocks"]),
                                  max_num_seqs=int(row["max_num_seqs"]),
                                  registration_ttl_s=float(row.get(
                                      "registration_ttl_s", DEFAULT_REGISTRATION_TTL_S)))
                started = float(row["started_at"])
            except (KeyError, ValueError) as e:
                if key not in self._bad_keys:
                    logger.warning("ignoring malformed worker entry %s: %r", key, e)
                    self._bad_keys.add(key)
                continue
            # a restarted worker under a new id may leave its old entry until that expires
            if w.address not in newest or started > newest[w.address][0]:
                newest[w.address] = (started, w)
        found = [w for _, w in newest.values()]
        found += self._not_back_yet({w.address for w in found})
        self._last = sorted(found, key=lambda w: (w.role, w.address))
        return list(self._last)

    def _not_back_yet(self, found: set[str]) -> list[WorkerAddress]:
        """Workers known before the last outage, missing from Redis now, whose registration
        ttl has not passed since Redis answered again (see the class docstring)."""
        if self._back_at is None:
            return []
        since = time.monotonic() - self._back_at
        kept = [w for w in self._last if w.address not in found
                and since < (w.registration_ttl_s or DEFAULT_REGISTRATION_TTL_S)]
        if not kept:
            self._back_at = None  # every worker is back, or had its chance
        return kept

    async def prefix_overlap(self, worker_ids: Sequence[str],
                             block_hashes: Sequence[int]) -> dict[str, int] | None:
        """{worker_id: how many of the leading block_hashes it holds, unexpired}; None when
        Redis did not answer within PREFIX_QUERY_TIMEOUT_S."""
        held = await self._leading(worker_ids, block_hashes, offload=False)
        return None if held is None else {w: pool for w, (pool, _) in held.items()}

    async def offload_overlap(self, worker_ids: Sequence[str], block_hashes: Sequence[int],
                              peers: Mapping[str, Sequence[str]] | None = None
                              ) -> dict[str, tuple[int, int]] | None:
        """{worker_id: (leading blocks in its pool, leading blocks in its pool or its offload
        tiers)}, one round trip; None when Redis did not answer in time. peers: per worker,
        the others (among worker_ids) sharing one of its tiers, whose stored blocks count as
        held in its tiers too."""
        return await self._leading(worker_ids, block_hashes, offload=True, peers=peers)

    async def _leading(self, worker_ids: Sequence[str], block_hashes: Sequence[int],
                       offload: bool, peers: Mapping[str, Sequence[str]] | None = None
                       ) -> dict[str, tuple[int, int]] | None:
        if not worker_ids or not block_hashes:
            return dict.fromkeys(worker_ids, (0, 0))
        peers = peers or {}
        members = [block_member(h) for h in block_hashes]
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.zmscore(self.config.prefix_key(worker_id), members)
            if offload:
                pipe.zmscore(self.config.offload_key(worker_id), members)
        try:
            scores = await asyncio.wait_for(pipe.execute(), PREFIX_QUERY_TIMEOUT_S)
            self._prefix_outage.ok()
        except REDIS_ERRORS as e:
            self._prefix_outage.failed(self.config.describe(e))
            return None
        now = time.time()  # the workers' clocks wrote the expiries: skew << PREFIX_TTL_S

        def leading(*sets: list) -> int:
            n = 0
            while n < len(members) and any(s[n] is not None and s[n] > now for s in sets):
                n += 1
            return n

        per = 2 if offload else 1
        stored = ({w: scores[i * per + 1] for i, w in enumerate(worker_ids)} if offload
                  else {})
        out = {}
        for i, worker_id in enumerate(worker_ids):
            pool = scores[i * per]
            n = leading(pool)
            if offload:
                shared = [stored[p] for p in peers.get(worker_id, ()) if p in stored]
                out[worker_id] = (n, leading(pool, stored[worker_id], *shared))
            else:
                out[worker_id] = (n, n)
        return out

    async def close(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            await self._redis.aclose()
