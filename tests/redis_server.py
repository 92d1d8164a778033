"""A private, real `redis-server` for tests (the Debian package; .ci/run installs it), on a free
port in a temporary directory, with nothing saved to disk:

    with run_redis(tmp_path) as server:                      # plain
        RedisConfig(server.url)
    with run_redis(tmp_path, password="s3cret") as server:   # --requirepass
    with run_redis(tmp_path, tls=make_certs(tmp_path)) as server:   # TLS only, mutual
        RedisConfig(server.url, tls_ca=..., tls_cert=..., tls_key=...)

The certificates are tests/tls_certs.py's: the server and its clients present the same one,
signed by the test CA.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tls_certs import CertFiles

START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RedisServer:
    proc: subprocess.Popen
    port: int
    url: str  # redis:// or rediss://, never with the password
    password: str | None
    tls: CertFiles | None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_ping(port: int, password: str | None, tls: CertFiles | None) -> bool:
    import redis

    kwargs = {}
    if tls is not None:
        kwargs = dict(ssl=True, ssl_ca_certs=str(tls.ca), ssl_certfile=str(tls.cert),
                      ssl_keyfile=str(tls.key))
    client = redis.Redis(port=port, password=password, socket_timeout=1, **kwargs)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


@contextlib.contextmanager
def run_redis(tmp_dir: Path, password: str | None = None,
              tls: CertFiles | None = None) -> Iterator[RedisServer]:
    """Start redis-server, wait for PING, yield it; stop it afterwards (SIGTERM, then KILL)."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    port = free_port()
    argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_dir)]
    if tls is None:
        argv += ["--port", str(port)]
    else:  # TLS only; clients must present a certificate signed by the CA
        argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert),
                 "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca),
                 "--tls-auth-clients", "yes"]
    if password is not None:
        argv += ["--requirepass", password]
    log = open(tmp_dir / f"redis-{port}.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_dir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(port, password, tls):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: "
                                   f"{(tmp_dir / f'redis-{port}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        scheme = "redis" if tls is None else "rediss"
        yield RedisServer(proc, port, f"{scheme}://127.0.0.1:{port}/0", password, tls)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
