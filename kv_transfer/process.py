"""Which process is writing: the identity a one-sided sender (shm, cuda_ipc; same host)
gives the receiver, so that the receiver never frees blocks a live sender may still write.

A process is named by its pid and its start time (clock ticks since boot, /proc/<pid>/stat
field 22): together they survive pid reuse, and a pid from another pid namespace (another
container) does not match. Where /proc is missing, identities are unknown (0) and the
receiver falls back to the lease deadline alone.
"""

from __future__ import annotations

import os


def start_ticks(pid: int) -> int:
    """The start time of process `pid` in clock ticks, 0 if unknown or not running (zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return 0
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3
    if not fields or fields[0] in ("Z", "X"):  # exited, not yet reaped: writes nothing
        return 0
    return int(fields[19])  # field 22 of the whole line


def my_identity() -> tuple[int, int]:
    """(pid, start ticks) of this process."""
    return os.getpid(), start_ticks(os.getpid())


def is_running(pid: int, ticks: int) -> bool:
    """Whether the process (pid, ticks) still runs (False when either is unknown)."""
    return pid > 0 and ticks > 0 and start_ticks(pid) == ticks
