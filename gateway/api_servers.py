"""`pdserve gateway --api-servers N`: N gateway processes on the same HTTP and gRPC ports
(SO_REUSEPORT: the kernel spreads connections over them), so a node's spare cores serve the
token stream (vLLM's --api-server-count).

    pdserve gateway --api-servers N ...    this process: a supervisor, serving nothing itself
      -> N children `pdserve gateway ... --api-server-index i`, each a whole gateway (its own
         connections to the workers, its own output streams)
      -> "pdserve gateway: gRPC ... HTTP ..." once every child is ready
      SIGTERM / SIGINT -> every child drains (a second signal: at once); exit 0 only if all did

What N processes must agree on is shared through a directory the supervisor makes (and
removes): Prometheus' multiprocess files (PROMETHEUS_MULTIPROC_DIR: /metrics on any child is
the sum over all of them; the scrape-time gauges are mirrored into it each second, see
MetricsMirror), and the canary, which only child 0 runs, its verdict written there for the
others' readiness (gateway/disagg/canary.py's CanaryVerdict). /internal/status answers for the child that took it.
The disaggregated mode only: a colocated gateway's engine lives in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)
SHARED_DIR_ENV = "PDSERVE_API_SERVERS_DIR"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_READY = re.compile(r"pdserve gateway: gRPC (\S+)\s+HTTP (\S+)")
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
MIRROR_S = 1.0


def shared_dir() -> Path | None:
    """The directory the API servers of one gateway share; None for a lone gateway."""
    value = os.environ.get(SHARED_DIR_ENV)
    return Path(value) if value else None


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_api_servers(args: argparse.Namespace, argv: list[str]) -> int:
    """The supervisor (see the module docstring); argv: this command's own arguments."""
    if args.colocated:
        raise ValueError("--api-servers > 1 needs the disaggregated mode (--prefill and "
                         "--decode, or --redis-url): a colocated gateway's engine runs in "
                         "its own process")
    grpc_port = args.port or free_port(args.host)
    http_port = args.http_port or free_port(args.host)
    shared = Path(tempfile.mkdtemp(prefix="pdserve-api-servers-"))
    (shared / "metrics").mkdir()
    env = {**os.environ, SHARED_DIR_ENV: str(shared), MULTIPROC_ENV: str(shared / "metrics"),
           "PYTHONUNBUFFERED": "1"}
    base = _without(argv, ("--api-servers", "--port", "--http-port", "--api-server-index"))
    children: list[subprocess.Popen] = []
    stop = {"signals": 0}

    def on_signal(signum, frame) -> None:
        stop["signals"] += 1
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM if stop["signals"] == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(args.api_servers):
            children.append(subprocess.Popen(
                [sys.executable, "-m", "pdserve", *base, "--port", str(grpc_port),
                 "--http-port", str(http_port), "--api-server-index", str(i)],
                env=env, stdout=subprocess.PIPE, text=True, start_new_session=False))
        addresses = _wait_ready(children)
        if addresses is not None:
            print(f"pdserve gateway: gRPC {addresses[0]}  HTTP {addresses[1]}  "
                  f"({args.api_servers} API servers; Ctrl-C stops)", flush=True)
        codes = [_drain_output(child, shared / "metrics") for child in children]
        return 0 if addresses is not None and all(c == 0 for c in codes) else 1
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(shared, ignore_errors=True)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without these flags (with their values, `--flag v` or `--flag=v`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _wait_ready(children: list[subprocess.Popen]) -> tuple[str, str] | None:
    """Each child's ready line (their output passed on meanwhile); None if one exited."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    addresses = None
    for child in children:
        while True:
            line = child.stdout.readline()
            if not line:  # it exited before it was ready
                return None
            match = _READY.search(line)
            if match:
                addresses = (match.group(1), match.group(2))
                break
            print(line, end="", flush=True)
            if time.monotonic() > deadline:
                return None
    return addresses


def _drain_output(child: subprocess.Popen, metrics_dir: Path) -> int:
    from prometheus_client import multiprocess

    for line in child.stdout:
        print(line, end="", flush=True)
    code = child.wait()
    multiprocess.mark_process_dead(child.pid, str(metrics_dir))  # its live gauges leave the sums
    return code


class MetricsMirror:
    """Each second, this process's scrape-time gauges and counters (the gateway collector's,
    gateway/metrics.py) written into Prometheus' multiprocess files, so that /metrics on any
    API server sums them: gauges as live sums (or maxima, for what every process sees alike),
    counters as increments."""

    def __init__(self, collector) -> None:
        from prometheus_client import Counter, Gauge

        self.collector = collector
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}
        self._metrics: dict[str, object] = {}
        self._gauge, self._counter = Gauge, Counter
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            try:
                self.mirror()
            except Exception:  # a bad sample must not stop the mirroring for good
                logger.exception("mirroring the gateway's gauges for /metrics failed")
            await asyncio.sleep(MIRROR_S)

    def mirror(self) -> None:
        for family in self.collector.collect():
            if not family.samples:  # nothing to say yet (a canary that has not run)
                continue
            metric = self._metrics.get(family.name)
            names = sorted(family.samples[0].labels)
            if metric is None:
                if family.type == "counter":
                    metric = self._counter(family.name, family.documentation, names,
                                           registry=None)
                else:
                    mode = "livesum" if family.name.endswith(("running", "waiting")) \
                        else "livemax"
                    metric = self._gauge(family.name, family.documentation, names,
                                         registry=None, multiprocess_mode=mode)
                self._metrics[family.name] = metric
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                values = tuple(sample.labels[n] for n in names)
                child = metric.labels(*values) if names else metric
                if family.type == "counter":
                    key = (family.name, values)
                    delta = sample.value - self._last.get(key, 0.0)
                    if delta > 0:
                        child.inc(delta)
                    self._last[key] = sample.value
                else:
                    child.set(sample.value)
