"""Simulated hosts on one Linux machine: each a network, mount, UTS and PID namespace of its
own, with a private /dev/shm and machine id, plugged into one bridge.

    with Network() as net:                       # a bridge on a free /24 of 198.18.0.0/15
        a, b = net.add_host("a"), net.add_host("b", machine_id=...)   # same id: same "node"
        proc = a.spawn(["redis-server", ...], log_path)   # runs inside host a
        net.shape(b, rate_bits=10e9)             # tc tbf on both directions of b's link
        net.set_link(b, up=False)                # b's cable pulled (silent: packets vanish)
        net.partition(a, b)                      # a and b no longer hear each other
        net.heal(a, b)
    # everything it made is gone: processes, namespaces, links, the bridge

A host is a named network namespace (`ip netns`) with a veth pair to the bridge (`eth0`
inside), plus an init process (`sleep`, PID 1 of the host's PID namespace) that holds the
mount and UTS namespaces; programs enter all of them with nsenter. Killing the init kills every
process of the host (the kernel does so when a PID namespace's init dies).

Invariants:
- Every name this module makes starts with NAME_PREFIX and the network's tag (three hex
  digits: which /24 of 198.18.0.0/15 it owns), and a state directory STATE_DIR/<tag> records
  its owner (pid and start time) before anything is made. A network whose owner is gone is
  swept (processes killed, namespaces and links deleted) by the next Network() on the machine,
  and names with the prefix but no state directory are swept too.
- Inits are spawned with the parent-death signal and `unshare --kill-child`: if the owner dies
  (even by SIGKILL), every host process dies with it; only namespace and link names remain,
  for the sweep. close() runs on every path (context manager, atexit).
- Partitions drop packets silently, as a real network does: a pulled link drops everything
  (the peer end has no carrier); partition(a, b) drops what each receives from the other (a
  policy-routing blackhole on input, so neither sender gets a local error).
- Needs root (namespaces, veth, bridge, tc): require_root() says so clearly.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster.names import (  # noqa: F401 (the names and sweep: re-exported)
    NAME_PREFIX,
    STATE_DIR,
    SUPERNET,
    claim_subnet,
    run,
    start_ticks,
    sweep,
    teardown,
)
from pdserve.supervisor import dying_with_parent

TOOLS = ("ip", "tc", "nsenter", "unshare", "setpriv", "sh", "sleep", "mount")
INIT_TIMEOUT_S = 10.0
DEFAULT_SHM_SIZE = "1g"


class NeedsRoot(RuntimeError):
    """The harness cannot run here; the message says what is missing."""


def require_root() -> None:
    """NeedsRoot unless this process is root and has the tools (iproute2, util-linux)."""
    if os.geteuid() != 0:
        raise NeedsRoot("the cluster harness needs root: it makes network, mount and PID "
                        "namespaces, veth pairs, a bridge and tc qdiscs (.ci/run runs as "
                        "root; locally: sudo -E python -m pytest -m cluster)")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise NeedsRoot(f"the cluster harness needs {', '.join(missing)} on PATH "
                        "(Debian: iproute2, util-linux)")


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _wait_child(pid: int, comm: str | None, what: str) -> int:
    """The child of `pid` (whose command name is `comm`, if given), once it exists."""
    deadline = time.monotonic() + INIT_TIMEOUT_S
    while True:
        for child in child_pids(pid):
            try:
                name = Path(f"/proc/{child}/comm").read_text().strip()
            except OSError:
                continue
            if comm is None or name == comm:
                return child
        if time.monotonic() > deadline or start_ticks(pid) is None:
            raise RuntimeError(f"{what} did not start within {INIT_TIMEOUT_S} s")
        time.sleep(0.01)


@dataclass
class HostProcess:
    """A program running on a host. `popen` is its nsenter (which exits with the program's
    code); `pid` the program itself, as this (the root) PID namespace numbers it."""

    name: str
    popen: subprocess.Popen
    pid: int
    log: Path
    log_offset: int = 0  # the log's size when it started (a restart appends to the same log)

    def output(self) -> str:
        """What this process wrote to its log."""
        with open(self.log, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def poll(self) -> int | None:
        return self.popen.poll()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then the exit code; SIGKILL if it outlives `timeout_s` (TimeoutExpired is
        not raised: the caller checks the code, -9)."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGUSR1)  # pdserve prints its threads' stacks to the log
            time.sleep(0.5)
            self.signal(signal.SIGKILL)
            return self.popen.wait(10)


@dataclass
class Host:
    name: str
    index: int  # its veth's number; address: the network's .index+1
    ip: str
    netns: str
    root_veth: str  # the bridge side of its link (eth0 inside is the other end)
    machine_id: str
    init: subprocess.Popen | None = None
    init_pid: int = 0  # PID 1 of the host's PID namespace, numbered from the root one
    processes: list[HostProcess] = field(default_factory=list)
    blocked: set[str] = field(default_factory=set)  # ips it drops (partition)

    def spawn(self, argv: list[str], log: Path, name: str, env: dict[str, str] | None = None,
              cwd: str | None = None) -> HostProcess:
        """Run argv on this host (its network, mounts, hostname and PIDs), output to `log`;
        env replaces the environment (None: this process's)."""
        assert self.init_pid, f"host {self.name} is not running"
        cwd = cwd or os.getcwd()
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                dying_with_parent(["nsenter", "-t", str(self.init_pid), "-n", "-m", "-u", "-p",
                                   f"--wd={cwd}", "--", *argv]),
                stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        try:
            pid = _wait_child(popen.pid, None, f"{name} on host {self.name}")
        except RuntimeError:
            popen.kill()
            raise RuntimeError(f"{name} on {self.name} exited at once: "
                               f"{log.read_text(errors='replace')[-2000:]}") from None
        proc = HostProcess(name, popen, pid, log, offset)
        self.processes.append(proc)
        return proc

    def run(self, *argv: str) -> str:
        """A short command inside the host's namespaces; its stdout (RuntimeError on failure)."""
        return run("nsenter", "-t", str(self.init_pid), "-n", "-m", "-u", "-p", "--",
                    *argv).stdout


class Network:
    """A bridge and the hosts on it (see the module docstring). Use it as a context manager;
    close() is idempotent and also registered with atexit."""

    def __init__(self, shm_size: str = DEFAULT_SHM_SIZE) -> None:
        require_root()
        sweep()
        self.shm_size = shm_size
        self.tag, self.subnet = claim_subnet()
        self.state = STATE_DIR / self.tag
        self.bridge = f"{NAME_PREFIX}{self.tag}"
        self.hosts: dict[str, Host] = {}
        self._closed = False
        atexit.register(self.close)
        try:
            gateway = self._address(1)
            run("ip", "link", "add", self.bridge, "type", "bridge")
            run("ip", "addr", "add", f"{gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            run("ip", "link", "set", self.bridge, "up")
            self.root_ip = gateway  # this (the root) namespace's address on the bridge
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _address(self, n: int) -> str:
        return str(self.subnet.network_address + n)

    # -- hosts ---------------------------------------------------------------------------------
    def add_host(self, name: str, machine_id: str | None = None) -> Host:
        """A new host on the bridge, running; `machine_id`: another host's to make the two
        "one node" (shared kernel, separate /dev/shm: pods of one node)."""
        if name in self.hosts or not name.replace("-", "").isalnum():
            raise ValueError(f"host name {name!r}: taken or not [a-z0-9-]")
        index = len(self.hosts) + 1
        if index > 250:
            raise ValueError("at most 250 hosts on one network")
        host = Host(name, index, self._address(index + 1), f"{self.bridge}-{name}",
                    f"{self.bridge}v{index}", machine_id or uuid.uuid4().hex)
        self.hosts[name] = host
        peer = f"{self.bridge}p{index}"
        ns = ("ip", "-n", host.netns)
        run("ip", "netns", "add", host.netns)
        run("ip", "link", "add", host.root_veth, "type", "veth", "peer", "name", peer)
        run("ip", "link", "set", peer, "netns", host.netns)
        run(*ns, "link", "set", peer, "name", "eth0")
        run(*ns, "addr", "add", f"{host.ip}/{self.subnet.prefixlen}", "dev", "eth0")
        run(*ns, "link", "set", "eth0", "up")
        run(*ns, "link", "set", "lo", "up")
        run("ip", "link", "set", host.root_veth, "master", self.bridge, "up")
        # the local table after the partition rules (pref 10..), so those see input first
        run(*ns, "rule", "add", "pref", "100", "lookup", "local")
        run(*ns, "rule", "del", "pref", "0")
        self._start_init(host)
        return host

    def _start_init(self, host: Host) -> None:
        mid = self.state / f"machine-id-{host.name}"
        mid.write_text(host.machine_id + "\n")
        binds = " && ".join(f"mount --bind {mid} {p}" for p in _machine_id_paths())
        script = (f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm && "
                  f"{binds + ' && ' if binds else ''}hostname {host.name} && "
                  "exec sleep infinity")
        host.init = subprocess.Popen(
            dying_with_parent(["ip", "netns", "exec", host.netns, "unshare", "--mount", "--uts",
                               "--pid", "--fork", "--mount-proc", "--kill-child", "--", "sh",
                               "-c", script]),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            host.init_pid = _wait_child(host.init.pid, "sleep", f"host {host.name}'s init")
        except RuntimeError as e:
            host.init.kill()
            raise RuntimeError(f"{e}: {host.init.communicate()[1]}") from None

    # -- links ---------------------------------------------------------------------------------
    def shape(self, host: Host, rate_bits: float | None) -> None:
        """Limit the host's link to `rate_bits` per second each way (tc tbf on both veth
        ends); None removes the limit. The bucket holds 1 ms at that rate (at least 128 KiB,
        so that one GSO packet fits)."""
        for argv in (("tc",), ("tc", "-n", host.netns)):
            dev = host.root_veth if len(argv) == 1 else "eth0"
            run(*argv, "qdisc", "del", "dev", dev, "root", check=False)
            if rate_bits is not None:
                burst = max(128 * 1024, int(rate_bits / 8 / 1000))
                run(*argv, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                     f"{int(rate_bits)}bit", "burst", str(burst), "latency", "200ms")

    def set_link(self, host: Host, up: bool) -> None:
        """Plug (up) or pull (down) the host's cable: down, nothing reaches or leaves it."""
        run("ip", "link", "set", host.root_veth, "up" if up else "down")

    def partition(self, a: Host, b: Host) -> None:
        """a and b drop every packet from each other; both still reach everyone else."""
        for me, other in ((a, b), (b, a)):
            if other.ip not in me.blocked:
                run("ip", "-n", me.netns, "rule", "add", "pref", str(10 + other.index),
                     "from", other.ip, "iif", "eth0", "blackhole")
                me.blocked.add(other.ip)

    def heal(self, a: Host, b: Host) -> None:
        for me, other in ((a, b), (b, a)):
            if other.ip in me.blocked:
                run("ip", "-n", me.netns, "rule", "del", "pref", str(10 + other.index))
                me.blocked.discard(other.ip)

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every host's processes, then delete the namespaces, links and state."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for host in self.hosts.values():
            for proc in host.processes:
                proc.signal(signal.SIGKILL)
            if host.init is not None and host.init.poll() is None:
                host.init.kill()  # --kill-child: the init dies, and with it the PID namespace
        for host in self.hosts.values():
            for proc in host.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(10)
            if host.init is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.init.wait(10)
        teardown(self.tag)


def _machine_id_paths() -> list[str]:
    seen, out = set(), []
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        if os.path.isfile(path) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            out.append(path)
    return out
