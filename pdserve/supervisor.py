"""Child processes that `pdserve up` supervises: spawned so that they die with it, their output
forwarded with a name prefix, and restarted with backoff when they die.

    child = Child("prefill-0", argv, cores, "READY ")   # argv() -> its pdserve arguments
    child.spawn(on_ready)           # a process that gets SIGKILL if this one dies (any way)
    child.wait_ready(deadline)      # its ready line, or RuntimeError if it dies first
    supervise(children, stopping, policy, respawn)   # restarts the dead with backoff

`argv()` is called at every spawn: the caller learns a child's ports from its first ready
line (on_ready) and hands them back, so a restart binds the same ports again and the gateway
(static worker addresses) and the clients (the gateway's ports) find it where it was.

Orphans: every child is spawned with the Linux parent-death signal (PR_SET_PDEATHSIG,
SIGKILL, set by util-linux's setpriv: `dying_with_parent`), so a SIGKILL or OOM kill of the
supervisor kills its children too. The signal follows the *thread* that forked the child, so
children are only ever spawned from the supervisor's main thread. Nothing runs Python between
fork and exec (the supervisor has threads: its output pumps), and pinned children are pinned
by taskset in the same exec chain.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


def dying_with_parent(argv: list[str]) -> list[str]:
    """argv run so that it gets SIGKILL when this process dies, with no Python in the child
    between fork and exec: util-linux's setpriv sets the parent-death signal, then the shell
    checks that its parent is still this process (it could have died first) and execs argv.
    (A preexec_fn runs Python in a fork of a threaded process: one aborted there, in
    threading's after-fork lock reset.)"""
    return ["setpriv", "--pdeathsig", "KILL", "--", "sh", "-c",
            f'[ "$PPID" = {os.getpid()} ] || exit 1; exec "$@"', "sh", *argv]


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a dead child after `initial_backoff_s`, doubling with each crash inside
    `window_s` up to `max_backoff_s`; a child that crashed `max_crashes` times inside
    `window_s` is not restarted again (it keeps crashing: the stack stops)."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_crashes: int = 5
    window_s: float = 300.0

    def decide(self, crash_times: list[float], now: float) -> float | None:
        """Seconds to wait before restarting a child whose crashes (including the one just
        seen) happened at `crash_times`; None: it crashed too often, do not restart."""
        recent = [t for t in crash_times if now - t <= self.window_s]
        if len(recent) >= self.max_crashes:
            return None
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** (len(recent) - 1))


@dataclass
class Child:
    """One supervised process (`python -m pdserve ...`), respawned in place on restart."""

    name: str
    argv: Callable[[], list[str]]  # its pdserve arguments, asked again at every (re)spawn
    cores: list[int] | None  # CPU cores it is pinned to (None: any)
    ready_marker: str  # the prefix of the line it prints once it serves
    program: tuple[str, ...] = (sys.executable, "-m", "pdserve")  # what argv() is given to
    proc: subprocess.Popen | None = None
    ready_line: str | None = None  # the latest process's ready line (None until it prints it)
    metrics_url: str | None = None  # its Prometheus /metrics (workers print it)
    crash_times: list[float] = field(default_factory=list)
    restart_at: float | None = None  # when a pending restart is due (monotonic)
    lines: queue.Queue = field(default_factory=queue.Queue)  # the current process's output

    def spawn(self, on_ready: Callable[[Child], None] | None = None) -> None:
        """Start the process (from the main thread only: see the module docstring)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.cores:
            env["OMP_NUM_THREADS"] = str(len(self.cores))  # torch's threads = pinned cores
        self.ready_line = None
        self.lines = queue.Queue()
        argv = [*self.program, *self.argv()]
        if self.cores:
            argv = ["taskset", "--cpu-list", ",".join(map(str, self.cores)), *argv]
        if shutil.which("setpriv") is not None:
            argv = dying_with_parent(argv)
        else:  # (util-linux is essential on Debian; elsewhere it may be missing)
            logger.warning("setpriv not found (util-linux): %s would outlive a killed "
                           "pdserve up", self.name)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        threading.Thread(target=self._pump, args=(self.proc, self.lines, on_ready),
                         daemon=True).start()

    def _pump(self, proc: subprocess.Popen, lines: queue.Queue,
              on_ready: Callable[[Child], None] | None) -> None:
        """Forward the process's output, prefixed; note its metrics URL and ready line."""
        for line in proc.stdout:
            if line.startswith("METRICS "):
                self.metrics_url = line.split()[2]
            if line.startswith(self.ready_marker) and proc is self.proc:
                self.ready_line = line
                if on_ready is not None:
                    on_ready(self)
            lines.put(line)
            print(f"[{self.name}] {line}", end="", flush=True)
        lines.put(None)

    def wait_ready(self, deadline: float) -> str:
        """Block until the current process prints its ready line and return it; RuntimeError
        if it exits first or the deadline passes."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name} was not ready in time") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.wait()} before "
                                   f"it was ready (its output is above)")
            if line.startswith(self.ready_marker):
                return line
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready in time")

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float) -> bool:
        """SIGTERM, wait, SIGKILL after timeout_s. True if it exited with 0 by itself."""
        if self.proc is None:
            return True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                print(f"pdserve up: {self.name} did not stop within {timeout_s:.0f} s; killed",
                      file=sys.stderr, flush=True)
                return False
        if self.proc.returncode != 0:
            print(f"pdserve up: {self.name} exited with code {self.proc.returncode}",
                  file=sys.stderr, flush=True)
            return False
        return True


def supervise(children: list[Child], stopping: threading.Event, policy: RestartPolicy,
              respawn: Callable[[Child], None]) -> int | None:
    """Restart children that exit (`respawn(child)`, after the policy's backoff) until
    `stopping` is set: then None. 1 as soon as a child exits more often than the policy
    allows; the caller stops the rest."""
    while not stopping.is_set():
        now = time.monotonic()
        for c in children:
            if c.restart_at is None and not c.is_running:
                c.crash_times.append(now)
                delay = policy.decide(c.crash_times, now)
                code = c.proc.returncode
                if delay is None:
                    print(f"pdserve up: {c.name} exited with code {code}, its exit "
                          f"{policy.max_crashes} within {policy.window_s:.0f} s: it keeps "
                          f"crashing, so the stack stops", file=sys.stderr, flush=True)
                    return 1
                print(f"pdserve up: {c.name} exited with code {code}; restarting it in "
                      f"{delay:g} s (the others keep serving)", file=sys.stderr, flush=True)
                c.restart_at = now + delay
            elif c.restart_at is not None and now >= c.restart_at:
                c.restart_at = None
                respawn(c)
        stopping.wait(0.1)
    return None
