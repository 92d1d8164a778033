"""pdserve/supervisor.py: the restart policy's arithmetic, children that die with the
supervisor, and the supervising loop over real processes (restarts, then a crash loop)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.supervisor import Child, RestartPolicy, supervise
from tests.helpers import ROOT, is_alive, wait_until

POLICY = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=8.0, max_crashes=5, window_s=60.0)


@pytest.mark.parametrize(("crash_times", "expected"), [
    ([100.0], 1.0),  # the first crash: the initial backoff
    ([99.0, 100.0], 2.0),  # doubling with each crash in the window
    ([97.0, 98.0, 99.0, 100.0], 8.0),  # 1, 2, 4, 8
    ([10.0, 20.0, 30.0, 100.0], 1.0),  # crashes older than the window are forgotten
    ([96.0, 97.0, 98.0, 99.0, 100.0], None),  # the 5th in the window: no more restarts
])
def test_restart_policy(crash_times, expected):
    assert POLICY.decide(crash_times, now=100.0) == expected


def test_backoff_is_capped():
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=3.0, max_crashes=10)
    assert [policy.decide([0.0] * n, 1.0) for n in range(1, 5)] == [1.0, 2.0, 3.0, 3.0]


def _child(name: str, code: str) -> Child:
    return Child(name, lambda: ["-c", code], None, "READY", program=(sys.executable,))


def test_children_die_with_a_killed_supervisor():
    """SIGKILL of the supervising process (as an OOM kill would): its child gets the
    parent-death signal and dies too, instead of living on as an orphan."""
    script = (
        "import sys, time\n"
        "from pdserve.supervisor import Child\n"
        "c = Child('sleeper', lambda: ['-c', 'import time; time.sleep(120)'], None, 'READY',"
        " program=(sys.executable,))\n"
        "c.spawn()\n"
        "print('CHILD', c.proc.pid, flush=True)\n"
        "time.sleep(120)\n")
    with _parent(script) as (sup, pid):
        assert is_alive(pid)
        _kill(sup, pid, "the child to die with its supervisor")


def test_a_pinned_child_runs_on_its_cores_and_answers_sigterm():
    """A child pinned to a core (pdserve up's pools) runs there from its first instruction,
    as the same process the supervisor signals: SIGTERM reaches it, not a wrapper."""
    core = min(os.sched_getaffinity(0))
    child = Child("pinned", lambda: ["-c", "import time; print('READY', flush=True); "
                                     "time.sleep(120)"], [core], "READY",
                  program=(sys.executable,))
    child.spawn()
    try:
        child.wait_ready(time.monotonic() + 30)
        assert _comm(child.proc.pid).startswith("python")
        assert os.sched_getaffinity(child.proc.pid) == {core}
        child.stop(10.0)  # (False: a plain script dies of the signal, not exit code 0)
        assert child.proc.returncode == -signal.SIGTERM
    finally:
        if child.proc.poll() is None:
            child.proc.kill()


@pytest.mark.parametrize("parent_first", [False, True])
def test_a_command_dying_with_its_parent(parent_first):
    """dying_with_parent (the cluster's hosts): the command gets SIGKILL when the process that
    started it is killed; one whose parent is gone before its shell checks does not run."""
    script = (
        "import subprocess, sys, time\n"
        "from pdserve.supervisor import dying_with_parent\n"
        "argv = dying_with_parent(['sleep', '120'])\n"
        "if sys.argv[1] == 'gone':  # a parent pid that is not the shell's parent\n"
        "    argv[6] = argv[6].replace(str(__import__('os').getpid()), '1')\n"
        "p = subprocess.Popen(argv)\n"
        "print('CHILD', p.pid, flush=True)\n"
        "print('CODE', p.wait(), flush=True) if sys.argv[1] == 'gone' else time.sleep(120)\n")
    with _parent(script, "gone" if parent_first else "live") as (sup, pid):
        if parent_first:
            assert sup.stdout.readline().split() == ["CODE", "1"]
            return
        wait_until(lambda: _comm(pid) == "sleep", 5, "the command to start")
        _kill(sup, pid, "the command to die with its parent")


@contextlib.contextmanager
def _parent(script: str, *args: str):
    """A Python process running `script` from the repository root; yields it and the pid of
    the child it printed ("CHILD <pid>"), and kills it on the way out."""
    sup = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                           text=True, cwd=ROOT)
    try:
        line = sup.stdout.readline()
        assert line.startswith("CHILD"), line
        yield sup, int(line.split()[1])
    finally:
        if sup.poll() is None:
            sup.kill()


def _kill(sup: subprocess.Popen, pid: int, what: str) -> None:
    """SIGKILL the parent (as an OOM kill would); its child `pid` must die too."""
    sup.kill()
    sup.wait()
    wait_until(lambda: not is_alive(pid), 5, what)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def test_supervise_restarts_a_dead_child_then_stops_a_crash_loop(capfd):
    """A child that keeps exiting is restarted (with backoff) until the policy's bound; then
    supervise returns 1, saying why. A healthy child beside it is left alone."""
    crasher = _child("crasher", "import sys; sys.exit(3)")
    healthy = _child("healthy", "import time; time.sleep(60)")
    respawned = []

    def respawn(c: Child) -> None:
        respawned.append(c.name)
        c.spawn()

    for c in (crasher, healthy):
        c.spawn()
    healthy_pid = healthy.proc.pid
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, max_crashes=3)
    try:
        t0 = time.monotonic()
        assert supervise([crasher, healthy], threading.Event(), policy, respawn) == 1
        assert time.monotonic() - t0 >= 0.05 + 0.1  # the two backoffs were waited
        assert respawned == ["crasher", "crasher"]  # 3 exits: 2 restarts, then the stop
        assert healthy.proc.pid == healthy_pid and healthy.is_running
        err = capfd.readouterr().err
        assert err.count("crasher exited with code 3; restarting it in") == 2
        assert "crasher exited with code 3, its exit 3 within 300 s" in err
        assert "keeps crashing" in err
    finally:
        healthy.stop(5)


def test_supervise_returns_when_asked_to_stop():
    child = _child("sleeper", "import time; time.sleep(60)")
    child.spawn()
    stopping = threading.Event()
    try:
        threading.Timer(0.2, stopping.set).start()
        assert supervise([child], stopping, POLICY, lambda c: pytest.fail("no restart")) is None
        assert child.is_running
    finally:
        assert child.stop(5) is False  # SIGTERM ends `sleep` with -15, not 0 by itself
