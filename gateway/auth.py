"""Optional API keys at the gateway: the public APIs (gRPC Generation, HTTP /v1/*) admit a
request only with a known key; health checks, reflection and /metrics stay open (probes and
Prometheus do not carry keys).

    gRPC: metadata `authorization: Bearer <key>` (or `x-api-key: <key>`) -> UNAUTHENTICATED
    HTTP: header `Authorization: Bearer <key>` (what the openai client sends) -> 401
Keys come from --api-key (repeatable), the PDSERVE_API_KEYS environment variable (comma-
separated) and --api-key-file (one per line). Comparison takes constant time per key.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

ENV_VAR = "PDSERVE_API_KEYS"


class APIKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = tuple(k.strip().encode() for k in keys if k.strip())

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def admits(self, key: str | None) -> bool:
        """True when keys are off, or `key` is one of them."""
        if not self._keys:
            return True
        if not key:
            return False
        given = key.encode()
        # every key is compared, so the time taken does not tell which one came close
        return any([hmac.compare_digest(given, k) for k in self._keys])

    @classmethod
    def from_sources(cls, keys: Iterable[str] | None = None, key_file: str | None = None,
                     environ=os.environ) -> APIKeys:
        found = list(keys or ())
        found += environ.get(ENV_VAR, "").split(",")
        if key_file:
            found += Path(key_file).read_text().splitlines()
        return cls(found)


def bearer_token(value: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, else None."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def key_from_metadata(metadata) -> str | None:
    """The API key of a gRPC call's invocation metadata (authorization or x-api-key)."""
    for k, v in metadata or ():
        if k == "authorization":
            return bearer_token(v)
        if k == "x-api-key":
            return v.strip()
    return None
