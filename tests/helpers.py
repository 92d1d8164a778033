"""Helpers for the tests that run real `pdserve` processes (tests/gateway, tests/e2e).

    proc, log = spawn_pdserve("gateway", "--colocated", ..., name="gateway")  # output -> log
    match = wait_for_output(proc, log, READY_RE, timeout_s=180, what="the gateway")
    ...
    assert stop_process(proc) == 0   # SIGTERM, then the exit code

Output goes to a temporary file rather than a pipe, so that a chatty process never blocks on a
full pipe and a failing test can show the log's tail.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def spawn_pdserve(*argv: str, name: str,
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """`python -m pdserve ARGV...` from the repository root, stdout and stderr to a log file;
    `env` adds to (or overrides) this process's environment."""
    log = Path(tempfile.mkstemp(prefix=f"pdserve-{name}-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return proc, log


def log_tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"(no log: {e})"


def wait_for_output(proc: subprocess.Popen, log: Path, pattern: re.Pattern[str],
                    timeout_s: float, what: str) -> re.Match[str]:
    """The first match of `pattern` in the process's log; RuntimeError (with the log's tail)
    if the process exits or the time runs out first. The caller stops the process."""
    deadline = time.monotonic() + timeout_s
    while True:
        match = pattern.search(log.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was "
                               f"ready:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready within {timeout_s} s:\n{log_tail(log)}")
        time.sleep(0.1)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc), e.g. the workers `pdserve up` started in their
    own sessions, which a signal to its process group would not reach."""
    from pdserve.cluster.netns import child_pids as from_proc

    return from_proc(pid)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: children, their children, ..."""
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


def listeners(port: int) -> set[int]:
    """The pids holding a listening TCP socket on `port` (any address), from /proc: what a
    connect test cannot tell apart from another program that took the freed port."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for entry in Path("/proc").iterdir():
        if inodes and entry.name.isdigit():
            try:
                fds = list((entry / "fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    if str(fd.readlink()) in inodes:
                        pids.add(int(entry.name))
                except OSError:
                    continue
    return pids


def is_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM, then the exit code. If it does not exit in time, it prints its threads' stacks
    into its log (SIGUSR1: pdserve's faulthandler), then it and its direct children are
    killed and TimeoutExpired is raised."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        kill_tree(proc)
        raise


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and its direct children (only processes this test started)."""
    children = child_pids(proc.pid) if proc.poll() is None else []
    proc.kill()
    proc.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run this process's torch ops on n threads inside the block. `pdserve up` pins each
    worker to one core with one thread; an in-process reference on more threads than there are
    free cores (the workers, or anything else, busy) crawls as OpenMP threads wait on each
    other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str,
               interval_s: float = 0.05) -> T:
    """Poll `probe` until it returns something truthy, and return that; AssertionError naming
    `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def count_split_combines() -> list[int]:
    """From now on, one entry per split-decode combine that kernels.decode_attention launches
    (for the scripts that run the engine on the Triton kernels; imports triton)."""
    import kernels.decode_attention as decode_attention

    combines: list[int] = []
    combine = decode_attention.combine_splits

    def counted(*args, **kwargs):
        combines.append(1)
        return combine(*args, **kwargs)

    decode_attention.combine_splits = counted
    return combines


def prometheus_tool(name: str) -> str:
    """The path of Debian's `prometheus` or `promtool`; the test fails (never skips) without
    it, saying how to install it (.ci/run does)."""
    import shutil

    import pytest

    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: apt-get install prometheus (Debian's package "
                    "gives prometheus and promtool; .ci/run installs it)", pytrace=False)
    return found
