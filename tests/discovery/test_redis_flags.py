"""The --redis-* flags of `pdserve prefill|decode|gateway`, and what they build."""

from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from gateway.server import run_gateway
from pdserve.cli import apply_env_defaults, build_parser
from service_infra.redis_registry import RedisConfig
from service_infra.worker_registration import advertise_host, worker_registration
from tests.helpers import ROOT

ENGINE = SimpleNamespace(source=SimpleNamespace(name="m"), num_kv_blocks=100,
                         layout=SimpleNamespace(block_size=16, fingerprint=lambda: "f"))


def parse(*argv: str, environ=None):
    parser = build_parser()
    apply_env_defaults(parser, argv[0], environ or {})
    return parser.parse_args(argv)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_flags(role, tmp_path, monkeypatch):
    args = parse(role, "--port", "0", "--redis-url", "rediss://r:6380/1", "--redis-tls-ca",
                 __file__, "--redis-namespace", "prod", "--registration-ttl", "3",
                 environ={"PDSERVE_REDIS_PASSWORD": "pw"})
    config = RedisConfig.from_args(args)
    assert config == RedisConfig("rediss://r:6380/1", "pw", __file__, None, None, "prod")
    monkeypatch.delenv("POD_NAME", raising=False)
    reg = worker_registration(config, args, role, ENGINE)
    assert (reg.host, reg.worker_id, reg.ttl_s) == ("127.0.0.1", None, 3.0)  # id: at start
    assert (reg.info.role, reg.info.num_blocks, reg.info.max_num_seqs) == (role, 100, 64)
    monkeypatch.setenv("POD_NAME", f"{role}-7c9f")
    assert worker_registration(config, args, role, ENGINE).worker_id == f"{role}-7c9f"
    named = parse(role, "--redis-url", "redis://r:1", "--worker-id", "w1", "--advertise-host",
                  "10.0.0.5")
    reg = worker_registration(RedisConfig.from_args(named), named, role, ENGINE)
    assert (reg.host, reg.worker_id) == ("10.0.0.5", "w1")
    plain = parse(role)
    assert RedisConfig.from_args(plain) is None
    assert worker_registration(None, plain, role, ENGINE) is None


def test_advertise_host():
    assert advertise_host(SimpleNamespace(advertise_host=None, host="10.1.2.3")) == "10.1.2.3"
    assert advertise_host(SimpleNamespace(advertise_host="pod", host="0.0.0.0")) == "pod"
    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = None
    if own is None:
        with pytest.raises(ValueError, match="pass --advertise-host"):
            advertise_host(SimpleNamespace(advertise_host=None, host="0.0.0.0"))
    else:
        assert advertise_host(SimpleNamespace(advertise_host=None, host="0.0.0.0")) == own


def test_gateway_takes_exactly_one_way_to_find_workers():
    args = parse("gateway", "--redis-url", "redis://r:1", "--redis-namespace", "x")
    assert RedisConfig.from_args(args) == RedisConfig("redis://r:1", namespace="x")
    for argv in (("--redis-url", "redis://r:1", "--prefill", "a:1", "--decode", "b:1"),
                 ("--redis-url", "redis://r:1", "--colocated"), ()):
        with pytest.raises(ValueError, match="choose one backend"):
            run_gateway(parse("gateway", *argv))


@pytest.mark.parametrize("command", [["prefill", "--port", "0"], ["gateway", "--port", "0",
                                                                  "--http-port", "0"]])
def test_a_wrong_password_stops_the_process_with_a_clear_error(command, redis_password_server):
    """Before a worker loads its model; the message names the URL, not the password."""
    url = redis_password_server.url.replace("//", "//:wrong-secret@")
    out = subprocess.run([sys.executable, "-m", "pdserve", *command, "--redis-url", url],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    redacted = redis_password_server.url.replace("//", "//:***@")
    assert f"pdserve: error: redis at {redacted} refused the credentials" in out.stderr
    assert "wrong-secret" not in out.stdout + out.stderr
