"""The simulated hosts themselves (pdserve/cluster/netns.py): each has its own /dev/shm,
machine id, hostname and PIDs; a shaped link carries its rate; a pulled link and a partition
drop packets silently and heal; nothing is left behind on any path, even when the owner is
killed."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pdserve.cluster.netns import NAME_PREFIX, STATE_DIR, SUPERNET, Network, sweep
from tests.helpers import wait_until

pytestmark = pytest.mark.cluster

# a TCP sink: prints "READY", then for each connection the bytes it read and the seconds
# between its first and last byte
SINK = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.bind(("0.0.0.0", 7000)); s.listen()
    print("READY", flush=True)
    while True:
        c, _ = s.accept(); n = 0; t0 = None
        while True:
            b = c.recv(1 << 20)
            if not b: break
            t0 = t0 or time.monotonic(); n += len(b)
        print("GOT", n, time.monotonic() - (t0 or time.monotonic()), flush=True); c.close()
""")
SEND = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[3]))
    s.sendall(b"x" * int(sys.argv[2])); s.close(); print("SENT", flush=True)
""")


def names_of(tag: str) -> list[str]:
    """Namespaces and links on this machine named for network `tag`."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    out += [line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()]
    return [n for n in out if n.startswith(f"{NAME_PREFIX}{tag}")]


def connect_outcome(host, ip: str, timeout_s: float = 1.0) -> str:
    """'ok', 'timeout' or 'refused': a TCP connect from `host` to ip:7000."""
    script = (f"import socket\ntry:\n socket.create_connection(('{ip}', 7000), "
              f"timeout={timeout_s}); print('ok')\nexcept TimeoutError: print('timeout')\n"
              "except ConnectionRefusedError: print('refused')")
    return host.run(sys.executable, "-c", script).strip()


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    with Network() as network:
        for name in ("a", "b", "c"):
            network.add_host(name)
        network.add_host("d", machine_id=network.hosts["a"].machine_id)
        for name in ("b", "c"):  # sinks to connect to
            log = tmp_path_factory.mktemp("sink") / f"{name}.log"
            network.hosts[name].spawn([sys.executable, "-c", SINK], log, "sink")
            wait_until(lambda log=log: "READY" in log.read_text(), 20, f"sink on {name}")
        yield network


def test_each_host_has_its_own_shm_machine_id_hostname_and_pids(net):
    a, b, d = net.hosts["a"], net.hosts["b"], net.hosts["d"]
    a.run("sh", "-c", "echo x > /dev/shm/pdserve-harness-probe")
    assert a.run("ls", "/dev/shm").split() == ["pdserve-harness-probe"]
    assert b.run("ls", "/dev/shm").split() == []
    assert d.run("ls", "/dev/shm").split() == []  # same machine id, still its own /dev/shm
    assert not os.path.exists("/dev/shm/pdserve-harness-probe")
    ids = {h: net.hosts[h].run("cat", "/etc/machine-id").strip() for h in "abcd"}
    assert ids["a"] == a.machine_id == ids["d"] and len(set(ids.values())) == 3, ids
    assert [net.hosts[h].run("hostname").strip() for h in "abc"] == ["a", "b", "c"]
    # the host's own PID namespace: its init is 1, and it sees no process of this machine
    pids = {int(p) for p in a.run("ls", "/proc").split() if p.isdigit()}
    assert 1 in pids and os.getpid() not in pids and len(pids) <= 4, pids
    for host in net.hosts.values():
        assert ipaddress.ip_address(host.ip) in SUPERNET
        assert host.run("ip", "-o", "-4", "addr", "show", "eth0").split()[3] == \
            f"{host.ip}/24"


def test_a_shaped_link_carries_its_rate(net, tmp_path):
    """tbf on both ends of b's link: 6 MB at 100 Mbit/s take ~0.48 s either way (the
    unshaped veth moves them in a few ms)."""
    a, b, c = net.hosts["a"], net.hosts["b"], net.hosts["c"]
    rate, nbytes = 100e6, 6_000_000
    net.shape(b, rate)
    try:
        for src, dst in ((a, b), (b, c)):  # into b, out of b
            sink = next(p for p in dst.processes if p.name == "sink")
            before = sink.log.read_text().count("GOT")
            assert src.run(sys.executable, "-c", SEND, dst.ip, str(nbytes), "10").strip() == \
                "SENT"
            line = wait_until(lambda s=sink, n=before: s.log.read_text().splitlines()[
                n + 1:] if s.log.read_text().count("GOT") > n else None, 20, "the sink")
            got, seconds = int(line[0].split()[1]), float(line[0].split()[2])
            assert got == nbytes
            assert 0.8 <= (nbytes * 8 / rate) / seconds <= 1.15, (src.name, dst.name, seconds)
    finally:
        net.shape(b, None)
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", b.root_veth],
                                       capture_output=True, text=True).stdout


def test_a_pulled_link_is_silent_and_heals(net):
    a, b, c = net.hosts["a"], net.hosts["b"], net.hosts["c"]
    net.set_link(b, up=False)
    try:
        assert connect_outcome(a, b.ip) == "timeout"  # not refused: the packets vanish
        assert connect_outcome(a, c.ip) == "ok"
    finally:
        net.set_link(b, up=True)
    wait_until(lambda: connect_outcome(a, b.ip) == "ok", 10, "b reachable again")


def test_a_partition_cuts_one_pair_only_and_heals(net):
    a, b, c, d = (net.hosts[h] for h in "abcd")
    net.partition(a, b)
    try:
        assert connect_outcome(a, b.ip) == "timeout"
        assert connect_outcome(b, a.ip, 0.5) in ("timeout", "refused")  # a has no sink
        assert b.run(sys.executable, "-c", "print(1)").strip() == "1"
        assert connect_outcome(a, c.ip) == "ok" and connect_outcome(d, b.ip) == "ok"
        assert connect_outcome(b, c.ip) == "ok"
    finally:
        net.heal(a, b)
    assert connect_outcome(a, b.ip) == "ok"


def test_nothing_is_left_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"), Network() as network:
        tag = network.tag
        host = network.add_host("x")
        proc = host.spawn(["sleep", "600"], STATE_DIR / tag / "sleep.log", "sleep")
        assert names_of(tag)
        raise RuntimeError("boom")
    assert proc.poll() is not None and not os.path.exists(f"/proc/{proc.pid}")
    assert names_of(tag) == [] and not (STATE_DIR / tag).exists()


OWNER = textwrap.dedent("""
    import sys, time
    from pdserve.cluster.netns import Network
    net = Network()
    host = net.add_host("x")
    proc = host.spawn(["sleep", "600"], net.state / "sleep.log", "sleep")
    print(net.tag, proc.pid, host.init_pid, flush=True)
    time.sleep(600)
""")


def test_a_killed_owner_takes_its_processes_and_the_next_network_sweeps_the_rest():
    """SIGKILL of the owner (no atexit runs): the parent-death signal kills each host's init,
    and with it the host's PID namespace; the names are swept by the next harness."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        tag, pid, init_pid = owner.stdout.readline().split()
        assert names_of(tag) and os.path.exists(f"/proc/{pid}")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") and not os.path.exists(
        f"/proc/{init_pid}"), 10, "the host's processes to die with their owner")
    assert names_of(tag)  # only the names are left ...
    assert tag in sweep()  # ... until a sweep (every Network() runs one first)
    assert names_of(tag) == [] and not (STATE_DIR / tag).exists()
