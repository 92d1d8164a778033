"""A worker's registration in Redis (the key schema: service_infra/redis_registry.py).

    serving -> start(port): INCR {ns}:epoch:{id}, then HSET {ns}:worker:{role}:{id} + PEXPIRE ttl
            -> every ttl / 3: the whole hash again + PEXPIRE (a Redis that lost it gets it back)
            -> after each prefill: publish_prefix(hashes) -> ZADD {ns}:prefix:{id} (background)
               with offload tiers: publish_offloaded(hashes) -> ZADD {ns}:offload:{id}
    SIGTERM -> stop(): DEL the worker key and the prefix set, before draining (the offload
               set stays: a restart on the same tiers still holds those blocks)
A worker that dies stops heartbeating: its key expires within ttl, its prefix set within
prefix_ttl, its offload set within OFFLOAD_PREFIX_TTL_S, and the gateway drops it on its next
refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from service_infra.redis_registry import (
    EPOCH_TTL_S,
    OFFLOAD_PREFIX_TTL_S,
    PREFIX_TTL_S,
    REDIS_ERRORS,
    STOP_TIMEOUT_S,
    OutageLog,
    RedisConfig,
    RedisUnavailable,
    block_member,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker registers besides its address, id and epoch."""

    role: str
    model: str
    layout_fingerprint: str
    block_size: int
    num_blocks: int  # also the most prefix blocks it can hold (bounds its prefix ZSET)
    max_num_seqs: int
    num_offload_blocks: int = 0  # the most offload-tier blocks it records (0: no tiers)


class WorkerRegistration:
    """A worker's entry in Redis while it serves (service_infra/worker_server.py's Announcer).

    start(port) registers it once it is SERVING; a heartbeat rewrites the entry every ttl / 3;
    stop() deletes it, first thing on SIGTERM. publish_prefix() records blocks this worker
    holds without blocking or raising: a background task writes them, dropped while Redis is
    down (routing then just knows less)."""

    def __init__(self, config: RedisConfig, info: WorkerInfo, host: str,
                 worker_id: str | None = None, ttl_s: float = 10.0,
                 prefix_ttl_s: float = PREFIX_TTL_S) -> None:
        if ttl_s <= 0 or prefix_ttl_s <= 0:
            raise ValueError(f"ttls must be > 0, got {ttl_s} and {prefix_ttl_s}")
        self.config, self.info, self.host = config, info, host
        self.worker_id, self.ttl_s, self.prefix_ttl_s = worker_id, ttl_s, prefix_ttl_s
        self.address = ""
        self.epoch = 0
        self._redis: aioredis.Redis | None = None
        self._fields: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []
        # "prefix" / "offload": member -> expiry, oldest first; bounded by _caps
        self._pending: dict[str, dict[str, float]] = {"prefix": {}, "offload": {}}
        self._caps = {"prefix": max(1, info.num_blocks),
                      "offload": max(1, info.num_offload_blocks)}
        self._wake = asyncio.Event()
        self._outage = OutageLog(f"{info.role} registration")

    async def start(self, port: int) -> None:
        """Register as host:port (the bound port); RedisUnavailable if Redis refuses."""
        self.address = f"{self.host}:{port}"
        self.worker_id = self.worker_id or f"{self.info.role}-{self.host}-{port}"
        self._redis = await self.config.connect()
        try:
            self.epoch = await self._redis.incr(self.config.epoch_key(self.worker_id))
            self._fields = {k: str(v) for k, v in asdict(self.info).items()} | {
                "address": self.address, "worker_id": self.worker_id, "epoch": str(self.epoch),
                "started_at": f"{time.time():.3f}", "registration_ttl_s": str(self.ttl_s)}
            await self._write()
        except REDIS_ERRORS as e:
            await self._redis.aclose()
            raise RedisUnavailable(self.config.describe(e)) from None
        logger.info("registered %s %s at %s (epoch %d)", self.info.role, self.worker_id,
                    self.address, self.epoch)
        self._tasks = [asyncio.create_task(self._heartbeat()),
                       asyncio.create_task(self._publish())]

    async def _write(self) -> None:
        key = self.config.worker_key(self.info.role, self.worker_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, mapping=self._fields)
        pipe.pexpire(key, max(1, int(self.ttl_s * 1000)))
        pipe.expire(self.config.epoch_key(self.worker_id), EPOCH_TTL_S)
        await pipe.execute()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self._write()
                self._outage.ok()
            except REDIS_ERRORS as e:
                self._outage.failed(f"heartbeat failed, retrying: {self.config.describe(e)}")

    def publish_prefix(self, block_hashes: Sequence[int]) -> None:
        """Record that this worker holds these full blocks, for prefix_ttl_s from now."""
        self._record("prefix", block_hashes)

    def publish_offloaded(self, block_hashes: Sequence[int]) -> None:
        """Record that this worker's offload tiers hold these full blocks."""
        self._record("offload", block_hashes)

    def _ttl(self, kind: str) -> float:
        return self.prefix_ttl_s if kind == "prefix" else OFFLOAD_PREFIX_TTL_S

    def _record(self, kind: str, block_hashes: Sequence[int]) -> None:
        pending = self._pending[kind]
        expires = time.time() + self._ttl(kind)
        for h in block_hashes:
            member = block_member(h)
            pending.pop(member, None)  # re-inserted last: the newest
            pending[member] = expires
        while len(pending) > self._caps[kind]:
            del pending[next(iter(pending))]
        self._wake.set()

    async def _publish(self) -> None:
        """Write what publish_* gathered: batches form while a write is under way."""
        keys = {"prefix": self.config.prefix_key(self.worker_id),
                "offload": self.config.offload_key(self.worker_id)}
        while True:
            await self._wake.wait()
            self._wake.clear()
            batches = {kind: batch for kind, batch in self._pending.items() if batch}
            self._pending = {kind: {} for kind in self._pending}
            pipe = self._redis.pipeline(transaction=False)
            for kind, batch in batches.items():
                key = keys[kind]
                pipe.zadd(key, batch)
                pipe.zremrangebyscore(key, "-inf", time.time())  # expired
                # past the cap: the soonest to expire
                pipe.zremrangebyrank(key, 0, -(self._caps[kind] + 1))
                pipe.pexpire(key, int(self._ttl(kind) * 1000))  # a dead worker's set goes too
            try:
                await pipe.execute()
                self._outage.ok()
            except REDIS_ERRORS as e:
                self._outage.failed(f"prefix publication dropped: {self.config.describe(e)}")

    async def stop(self) -> None:
        """Deregister (worker key and prefix set; the epoch stays for the next start)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # no heartbeat after the DEL; bounded: a stop must not hang on Redis
            _, stuck = await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT_S)
            if stuck:
                logger.warning("%d registration task(s) did not stop within %.0f s",
                               len(stuck), STOP_TIMEOUT_S)
        if self._redis is None:
            return
        try:
            await asyncio.wait_for(self._redis.delete(
                self.config.worker_key(self.info.role, self.worker_id),
                self.config.prefix_key(self.worker_id)), STOP_TIMEOUT_S)
            logger.info("deregistered %s %s", self.info.role, self.worker_id)
        except REDIS_ERRORS as e:
            logger.warning("could not deregister (the key expires in %.0f s): %s", self.ttl_s,
                           self.config.describe(e))
        with contextlib.suppress(*REDIS_ERRORS):
            await asyncio.wait_for(self._redis.aclose(), STOP_TIMEOUT_S)
        self._redis = None


def advertise_host(args) -> str:
    """The host others reach this worker at: --advertise-host, else --host; for a wildcard
    --host (0.0.0.0, ::) this machine's address (in a pod: the pod's IP)."""
    if args.advertise_host:
        return args.advertise_host
    if args.host not in ("0.0.0.0", "::", ""):
        return args.host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise ValueError(f"--host {args.host}: this machine's address is unknown ({e}); "
                         f"pass --advertise-host") from None


async def checked_redis_config(args) -> RedisConfig | None:
    """The --redis-* flags (None without --redis-url), with Redis answering PING: a worker
    fails on bad flags, credentials or an unreachable Redis before it loads its model."""
    config = RedisConfig.from_args(args)
    if config is not None:
        await (await config.connect()).aclose()
    return config


def worker_registration(config: RedisConfig | None, args, role: str,
                        engine, num_offload_blocks: int = 0) -> WorkerRegistration | None:
    """The registration the flags ask for (None without a RedisConfig, i.e. no --redis-url).
    The engine (an LLMEngine) tells the model, KV layout and pool size; num_offload_blocks
    bounds the offload-tier blocks published (0: none)."""
    if config is None:
        return None
    info = WorkerInfo(role, engine.source.name, engine.layout.fingerprint(),
                      engine.layout.block_size, engine.num_kv_blocks, args.max_num_seqs,
                      num_offload_blocks)
    return WorkerRegistration(config, info, advertise_host(args),
                              args.worker_id or os.environ.get("POD_NAME") or None,
                              args.registration_ttl)
