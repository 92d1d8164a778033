"""Private real Redis servers for the discovery tests (tests/redis_server.py): one per test,
so every test starts from an empty keyspace."""

from __future__ import annotations

import pytest

from tests.redis_server import RedisServer, run_redis
from tests.tls_certs import make_certs

PASSWORD = "pdserve-test-secret"


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    with run_redis(tmp_path) as server:
        yield server


@pytest.fixture
def redis_password_server(tmp_path) -> RedisServer:
    """--requirepass PASSWORD."""
    with run_redis(tmp_path, password=PASSWORD) as server:
        yield server


@pytest.fixture
def redis_tls_server(tmp_path) -> RedisServer:
    """TLS only, and clients must present a certificate the test CA signed."""
    with run_redis(tmp_path, tls=make_certs(tmp_path)) as server:
        yield server
