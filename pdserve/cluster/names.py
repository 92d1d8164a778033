"""The names, addresses and state of the cluster harness's networks (pdserve/cluster/netns.py),
and the sweep of those whose owner is gone.

Every name a network makes starts with NAME_PREFIX and its tag, three hex digits: which /24 of
SUPERNET it owns (bridge pdsc<tag>, veths pdsc<tag>v<n> / p<n>, namespaces pdsc<tag>-<host>).
STATE_DIR/<tag> is created first, atomically (two harnesses never get one tag), and records the
owner's pid and start time; a network whose owner is gone is swept: the processes in its
namespaces killed, the namespaces and links deleted, the state removed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

NAME_PREFIX = "pdsc"  # pdserve cluster: bridge pdsc<tag>, veths pdsc<tag>v<n>, netns pdsc<tag>-*
STATE_DIR = Path("/run/pdserve-cluster")
SUPERNET = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: benchmarking, never routed


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    return done


def start_ticks(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def claim_subnet() -> tuple[str, ipaddress.IPv4Network]:
    """A /24 of SUPERNET that no interface here uses, claimed by creating its state directory
    (atomic: two harnesses never get the same one)."""
    used = run("ip", "-4", "-o", "addr", "show").stdout
    subnets = list(SUPERNET.subnets(new_prefix=24))
    order = list(range(len(subnets)))
    random.shuffle(order)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    for i in order:
        net = subnets[i]
        if any(f" {a}/" in used for a in (net.network_address + 1, net.network_address + 2)):
            continue
        tag = f"{i:03x}"
        try:
            (STATE_DIR / tag).mkdir()
        except FileExistsError:
            continue
        (STATE_DIR / tag / "owner").write_text(f"{os.getpid()} {start_ticks(os.getpid())}\n")
        return tag, net
    raise RuntimeError(f"no free /24 left in {SUPERNET}")


def _is_owner_alive(tag: str) -> bool:
    try:
        pid, ticks = (STATE_DIR / tag / "owner").read_text().split()
    except (OSError, ValueError):
        return False
    return str(start_ticks(int(pid))) == ticks


def _tags_on_machine() -> set[str]:
    """Tags of every namespace and link named with NAME_PREFIX here."""
    names = run("ip", "netns", "list").stdout.split() + [
        line.split(":")[1].strip().split("@")[0]
        for line in run("ip", "-o", "link", "show").stdout.splitlines()]
    n = len(NAME_PREFIX)
    return {name[n:n + 3] for name in names if name.startswith(NAME_PREFIX)
            and len(name) >= n + 3}


def sweep() -> list[str]:
    """Tear down every network whose owner is gone (and names of ours without a state
    directory); returns their tags. Networks of live owners are left alone."""
    tags = _tags_on_machine()
    if STATE_DIR.exists():
        tags |= {p.name for p in STATE_DIR.iterdir() if p.is_dir()}
    swept = [tag for tag in sorted(tags) if not _is_owner_alive(tag)]
    for tag in swept:
        teardown(tag)
    return swept


def teardown(tag: str) -> None:
    """Kill the processes in tag's namespaces, delete the namespaces, links and state."""
    prefix = f"{NAME_PREFIX}{tag}"
    for ns in run("ip", "netns", "list").stdout.split():
        if not ns.startswith(prefix + "-"):
            continue
        for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        run("ip", "netns", "del", ns, check=False)
    for line in run("ip", "-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name == prefix or (name.startswith(prefix) and name[len(prefix)] in "vp"):
            run("ip", "link", "del", name, check=False)
    shutil.rmtree(STATE_DIR / tag, ignore_errors=True)
