"""The systems under test, started by the harness as subprocesses on free loopback ports:

| backend | command | healthy when |
| --- | --- | --- |
| naive | `python -m pdserve.bench.naive_server` (transformers generate, one request at a time) | GET /v1/models answers 200 |
| colocated | `pdserve gateway --colocated` | /v1/models 200 and gRPC health SERVING |
| disagg | `pdserve up --prefill N --decode M --transport T` | the same, on its gateway |
| conditional | the same with `--prefill-policy auto` | the same |
| always-remote | the same with `--prefill-policy always-remote` | the same |

Each runs in its own session (Ctrl-C in the terminal reaches the harness only), writes its output
to a log file, and is stopped by `stop`: SIGTERM, then SIGKILL for it and its direct children
(the workers `pdserve up` started in their own sessions) if it has not exited in time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_core.config import dtype_name
from engine_core.platforms import resolve_dtype
from pdserve.bench.args import BACKENDS

READY_TIMEOUT_S = 600.0  # `pdserve up` loads the model in three processes on two cores
STOP_TIMEOUT_S = 60.0  # `pdserve up` stops its gateway (which drains), then each worker
HOST = "127.0.0.1"
# the `pdserve up` backends and the --prefill-policy each passes (None: the stack's default)
DISAGG_POLICIES = {"disagg": None, "conditional": "auto", "always-remote": "always-remote"}


@dataclass(frozen=True)
class Target:
    """Where a system under test listens. grpc_address is None for the naive server."""

    name: str
    http_url: str | None
    grpc_address: str | None
    log: Path | None = None  # the server's output, when the harness started it


@dataclass(frozen=True)
class StackOptions:
    model: str | None = None
    dtype: str | None = None
    stack_args: tuple[str, ...] = ()  # passed to both `pdserve gateway --colocated` and `up`
    colocated_args: tuple[str, ...] = ()
    disagg_args: tuple[str, ...] = ()
    naive_args: tuple[str, ...] = ()
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "auto"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def command(backend: str, opts: StackOptions, grpc_port: int, http_port: int) -> list[str]:
    """The argv that starts `backend` on these ports."""
    common = (["--model", opts.model] if opts.model else []) + \
        (["--dtype", opts.dtype] if opts.dtype else [])
    if backend == "naive":
        # the dtype our stacks resolve "auto" to (bf16 where the CPU has it): transformers on
        # the same arithmetic (on a Zen 5 CPU its bf16 generate is the faster one, 42 tokens/s
        # against 24 in float32)
        dtype = opts.dtype or dtype_name(resolve_dtype(None, torch.device("cpu")))
        return [sys.executable, "-m", "pdserve.bench.naive_server", "--host", HOST, "--port",
                str(http_port), *(["--model", opts.model] if opts.model else []),
                "--dtype", dtype, *opts.naive_args]
    ports = ["--host", HOST, "--port", str(grpc_port), "--http-port", str(http_port)]
    if backend == "colocated":
        return [sys.executable, "-m", "pdserve", "gateway", "--colocated", *ports, *common,
                *opts.colocated_args, *opts.stack_args]
    if backend in DISAGG_POLICIES:
        policy = DISAGG_POLICIES[backend]
        return [sys.executable, "-m", "pdserve", "up", *ports, "--prefill", str(opts.num_prefill),
                "--decode", str(opts.num_decode), "--transport", opts.transport, *common,
                *(["--prefill-policy", policy] if policy else []), *opts.disagg_args,
                *opts.stack_args]
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def is_healthy(target: Target) -> bool:
    try:
        if target.http_url and httpx.get(f"{target.http_url}/v1/models",
                                          timeout=5).status_code != 200:
            return False
    except httpx.HTTPError:
        return False
    if target.grpc_address is None:
        return True
    with grpc.insecure_channel(target.grpc_address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def log_tail(log: Path, num_chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-num_chars:]
    except OSError as e:
        return f"(no log: {e})"


def wait_healthy(proc: subprocess.Popen, target: Target, timeout_s: float) -> None:
    """RuntimeError (with the log's tail) if the process exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not is_healthy(target):
        tail = log_tail(target.log) if target.log else ""
        if proc.poll() is not None:
            raise RuntimeError(f"{target.name} exited with code {proc.returncode} before it "
                               f"was healthy; its log ({target.log}) ends with:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{target.name} was not healthy within {timeout_s:.0f} s; its "
                               f"log ({target.log}) ends with:\n{tail}")
        time.sleep(0.5)


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # "pid (comm) state ppid ...": comm may contain spaces and parentheses
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def stop(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM, wait, then SIGKILL it and its direct children. The exit code (None: killed)."""
    if proc.poll() is not None:
        return proc.returncode
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    proc.kill()
    proc.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return None


class Server:
    """A system under test started as a subprocess: `start` returns at once (so that several
    can load at the same time), `wait_healthy` blocks until it serves, `stop` ends it."""

    def __init__(self, backend: str, opts: StackOptions, log_dir: Path,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        """env, cwd: the process's (default: this one's, with unbuffered output); the
        host-overhead bench runs another checkout's code so."""
        grpc_port, http_port = free_port(), free_port()
        argv = command(backend, opts, grpc_port, http_port)
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{backend}.log"
        self.target = Target(backend, f"http://{HOST}:{http_port}",
                             None if backend == "naive" else f"{HOST}:{grpc_port}", log)
        with open(log, "w") as out:
            out.write(f"$ {' '.join(argv)}\n")
            out.flush()
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=cwd,
                                         env=env or {**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> Target:
        wait_healthy(self.proc, self.target, timeout_s)
        return self.target

    def stop(self) -> None:
        code = stop(self.proc)
        if code not in (0, -signal.SIGTERM):
            print(f"pdserve bench: {self.target.name} exited with code {code}; see "
                  f"{self.target.log}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def launch(backend: str, opts: StackOptions, log_dir: Path,
           ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[Target]:
    """Start `backend`, wait until it is healthy, yield where it listens; stop it on exit,
    whatever happened (errors and Ctrl-C included)."""
    server = Server(backend, opts, log_dir)
    try:
        yield server.wait_healthy(ready_timeout_s)
    finally:
        server.stop()
