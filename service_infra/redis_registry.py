"""Discovery through Redis: the key schema and connection config that both sides share. The
workers' side is service_infra/worker_registration.py, the gateway's gateway/disagg/redis_discovery.py.

Keys (ns = --redis-namespace; three per worker, so cardinality follows the number of workers):

    {ns}:worker:{role}:{worker_id}  HASH    address, role, worker_id, model, layout_fingerprint,
                                            block_size, num_blocks, max_num_seqs, epoch,
                                            started_at, registration_ttl_s; expires ttl after
                                            the last heartbeat
    {ns}:epoch:{worker_id}          STRING  the restart epoch: INCR at each start; kept
                                            EPOCH_TTL_S after the worker's last heartbeat
    {ns}:prefix:{worker_id}         ZSET    member: the chain hash of a full prompt block the
                                            worker holds (engine_core/kv_cache/block_hash.py,
                                            16 hex digits); score: the unix time it stops
                                            counting; at most num_blocks members

A worker's life: serving -> INCR epoch -> HSET + PEXPIRE, again every ttl / 3 (the whole hash:
a Redis that lost it gets it back) -> SIGTERM -> DEL, before draining. A worker that dies stops
heartbeating: its key expires within ttl and the gateway drops it on its next refresh.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis

logger = logging.getLogger(__name__)
SOCKET_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 2.0  # deregistration must not hold up a shutdown when Redis is gone
EPOCH_TTL_S = 7 * 24 * 3600  # an epoch counter outlives restarts, not abandoned worker ids
PREFIX_TTL_S = 300.0
# blocks stored in a worker's offload tiers stay there until the tiers' LRU evicts them:
# their record is bounded by the tiers' size (WorkerInfo.num_offload_blocks), kept this long
OFFLOAD_PREFIX_TTL_S = 24 * 3600.0
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

    def offload_key(self, worker_id: str) -> str:
        """The blocks a worker stored in its offload tiers (kept across its restarts)."""
        return f"{self.namespace}:offload:{worker_id}"


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
