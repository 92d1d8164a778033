"""Discovery through Redis: the key schema both sides share and the gateway's view of the
pools (the workers' side: service_infra/worker_registration.py).

Keys (ns = --redis-namespace; three per worker, so cardinality follows the number of workers):

    {ns}:worker:{role}:{worker_id}  HASH    address, role, worker_id, model, layout_fingerprint,
                                            block_size, num_blocks, max_num_seqs, epoch,
                                            started_at; expires ttl after the last heartbeat
    {ns}:epoch:{worker_id}          STRING  the restart epoch: INCR at each start; kept
                                            EPOCH_TTL_S after the worker's last heartbeat
    {ns}:prefix:{worker_id}         ZSET    member: the chain hash of a full prompt block the
                                            worker holds (engine_core/kv_cache/block_hash.py,
                                            16 hex digits); score: the unix time it stops
                                            counting; at most num_blocks members

A worker's life: serving -> INCR epoch -> HSET + PEXPIRE, again every ttl / 3 (the whole hash:
a Redis that lost it gets it back) -> SIGTERM -> DEL, before draining. A worker that dies stops
heartbeating: its key expires within ttl and the gateway drops it on its next refresh.
The gateway: SCAN + pipelined HGETALL per refresh (once a second); per routed prompt one
pipelined ZMSCORE per candidate prefill worker (one round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis

from gateway.discovery import WorkerAddress

logger = logging.getLogger(__name__)
SOCKET_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 2.0  # deregistration must not hold up a shutdown when Redis is gone
EPOCH_TTL_S = 7 * 24 * 3600  # an epoch counter outlives restarts, not abandoned worker ids
PREFIX_TTL_S = 300.0
PREFIX_QUERY_TIMEOUT_S = 0.25  # routing waits this long for prefix information at most
REDIS_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)


class RedisUnavailable(RuntimeError):
    """Redis refused or could not be reached; the message names the URL, never the password."""


@dataclass(frozen=True)
class RedisConfig:
    """Where the registry lives. url: redis://HOST:PORT[/DB], or rediss:// for TLS (tls_ca
    verifies the server; tls_cert + tls_key authenticate this client)."""

    url: str
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    namespace: str = "pdserve"

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss") or not parts.netloc:
            raise ValueError(f"--redis-url must be redis://HOST:PORT[/DB] or rediss://... "
                             f"(TLS), got {self.redacted_url!r}")
        tls = {"--redis-tls-ca": self.tls_ca, "--redis-tls-cert": self.tls_cert,
               "--redis-tls-key": self.tls_key}
        if any(tls.values()) and parts.scheme != "rediss":
            flags = ", ".join(k for k, v in tls.items() if v)
            raise ValueError(f"{flags}: only for a rediss:// URL, got {self.redacted_url!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--redis-tls-cert and --redis-tls-key go together")
        for flag, path in tls.items():
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file: {path}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.namespace):
            raise ValueError(f"--redis-namespace must be letters, digits, '_', '.' or '-', "
                             f"got {self.namespace!r}")

    def __repr__(self) -> str:  # never the password (logs, tracebacks)
        return (f"RedisConfig({self.redacted_url!r}, password={'***' if self.password else None}"
                f", tls_ca={self.tls_ca!r}, tls_cert={self.tls_cert!r}, "
                f"namespace={self.namespace!r})")

    @classmethod
    def from_args(cls, args) -> RedisConfig | None:
        """From the --redis-* flags (service_infra/worker_args.py); None without --redis-url."""
        if not getattr(args, "redis_url", None):
            return None
        return cls(args.redis_url, args.redis_password or None, args.redis_tls_ca,
                   args.redis_tls_cert, args.redis_tls_key, args.redis_namespace)

    @property
    def redacted_url(self) -> str:
        """The URL with any password in it replaced by ***, for messages and logs."""
        scheme, sep, rest = self.url.partition("://")
        userinfo, at, hostpart = rest.rpartition("@")
        if not at or ":" not in userinfo:
            return self.url
        return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{hostpart}"

    def describe(self, e: BaseException) -> str:
        """What went wrong talking to Redis, for an error message or a log line."""
        if isinstance(e, redis.AuthenticationError):
            return (f"redis at {self.redacted_url} refused the credentials (the password: "
                    f"--redis-password or PDSERVE_REDIS_PASSWORD): {e}")
        return f"redis at {self.redacted_url} is unavailable: {type(e).__name__}: {e}"

    async def connect(self) -> aioredis.Redis:
        """A client that has answered PING; RedisUnavailable (with the reason) otherwise."""
        kwargs: dict[str, Any] = dict(decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S,
                                      socket_connect_timeout=SOCKET_TIMEOUT_S)
        if self.password is not None:
            kwargs["password"] = self.password
        if self.url.startswith("rediss://"):
            kwargs.update(ssl_ca_certs=self.tls_ca, ssl_certfile=self.tls_cert,
                          ssl_keyfile=self.tls_key)
        client = aioredis.from_url(self.url, **kwargs)
        try:
            await client.ping()
        except REDIS_ERRORS as e:
            await client.aclose()
            raise RedisUnavailable(self.describe(e)) from None
        return client

    # -- the key schema -------------------------------------------------------------------------
    def worker_key(self, role: str, worker_id: str) -> str:
        return f"{self.namespace}:worker:{role}:{worker_id}"

    def epoch_key(self, worker_id: str) -> str:
        return f"{self.namespace}:epoch:{worker_id}"

    def prefix_key(self, worker_id: str) -> str:
        return f"{self.namespace}:prefix:{worker_id}"


def block_member(block_hash: int) -> str:
    """A block hash as a prefix ZSET member."""
    return format(block_hash, "016x")


class OutageLog:
    """Logs the first failure of an outage and the recovery, not every failed attempt."""

    def __init__(self, what: str) -> None:
        self.what, self.is_down = what, False

    def failed(self, message: str) -> None:
        if not self.is_down:
            logger.warning("%s: %s", self.what, message)
        self.is_down = True

    def ok(self) -> None:
        if self.is_down:
            logger.warning("%s: redis answers again", self.what)
        self.is_down = False


class RedisDiscovery:
    """The gateway's Discovery (gateway/discovery.py) over the registered workers, and which
    prefill workers hold a prompt's leading blocks. While Redis is down, workers() answers
    what it last saw and prefix_overlap() None (routing by queue depth); each outage is
    logged once."""

    def __init__(self, config: RedisConfig, client: aioredis.Redis) -> None:
        self.config = config
        self._redis = client
        self._last: list[WorkerAddress] = []
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
            return list(self._last)
        newest: dict[str, tuple[float, WorkerAddress]] = {}  # address -> its newest entry
        for key, row in zip(keys, rows, strict=True):
            if not row:  # expired between SCAN and HGETALL
                continue
            try:
                w = WorkerAddress(row["role"], row["address"], worker_id=row["worker_id"],
                                  model=row["model"], layout_fingerprint=row["layout_fingerprint"],
                                  epoch=int(row["epoch"]), num_blocks=int(row["num_blocks"]),
                                  max_num_seqs=int(row["max_num_seqs"]))
                started = float(row["started_at"])
            except (KeyError, ValueError) as e:
                if key not in self._bad_keys:
                    logger.warning("ignoring malformed worker entry %s: %r", key, e)
                    self._bad_keys.add(key)
                continue
            # a restarted worker under a new id may leave its old entry until that expires
            if w.address not in newest or started > newest[w.address][0]:
                newest[w.address] = (started, w)
        self._last = sorted((w for _, w in newest.values()), key=lambda w: (w.role, w.address))
        return list(self._last)

    async def prefix_overlap(self, worker_ids: Sequence[str],
                             block_hashes: Sequence[int]) -> dict[str, int] | None:
        """{worker_id: how many of the leading block_hashes it holds, unexpired}; None when
        Redis did not answer within PREFIX_QUERY_TIMEOUT_S."""
        if not worker_ids or not block_hashes:
            return dict.fromkeys(worker_ids, 0)
        members = [block_member(h) for h in block_hashes]
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.zmscore(self.config.prefix_key(worker_id), members)
        try:
            scores = await asyncio.wait_for(pipe.execute(), PREFIX_QUERY_TIMEOUT_S)
            self._prefix_outage.ok()
        except REDIS_ERRORS as e:
            self._prefix_outage.failed(self.config.describe(e))
            return None
        now = time.time()  # the workers' clocks wrote the expiries: skew << PREFIX_TTL_S
        out = {}
        for worker_id, held in zip(worker_ids, scores, strict=True):
            n = 0
            while n < len(held) and held[n] is not None and held[n] > now:
                n += 1
            out[worker_id] = n
        return out

    async def close(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            await self._redis.aclose()
