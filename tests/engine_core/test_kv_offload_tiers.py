"""The KV offload tiers on their own (engine_core/kv_offload/): the entry format and its
checks, the disk tier on a real directory (budgets, warm restart, two processes, a full disk
and a read-only directory in a mount namespace of their own), the Redis tier on a real
redis-server (budget, a corrupt value, a killed server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from engine_core.kv_offload.entry import (
    HEADER_NBYTES,
    decode_entry,
    encode_entry,
    entry_key,
    namespace,
)
from engine_core.kv_offload.redis_tier import RedisTier
from engine_core.kv_offload.tiers import DiskTier, HostTier
from tests.redis_server import run_redis

NS = namespace("layout", "weights", "compute")
PAYLOAD = 4096


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, PAYLOAD, dtype=np.uint8)


def entry(seed: int) -> tuple[str, list]:
    return entry_key(NS, seed), encode_entry(NS, seed, payload(seed))


def joined(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


# -- the entry --------------------------------------------------------------------------------
def test_an_entry_round_trips_and_every_damage_is_refused():
    data = joined(encode_entry(NS, 7, payload(7)))
    assert len(data) == HEADER_NBYTES + PAYLOAD
    assert bytes(decode_entry(data, NS, 7, PAYLOAD)) == payload(7).tobytes()
    flipped = bytearray(data)
    flipped[HEADER_NBYTES + 100] ^= 0x01  # one bit of the payload
    assert decode_entry(bytes(flipped), NS, 7, PAYLOAD) is None
    header = bytearray(data)
    header[30] ^= 0x01  # the block hash in the header
    assert decode_entry(bytes(header), NS, 7, PAYLOAD) is None
    assert decode_entry(data[:-1], NS, 7, PAYLOAD) is None  # truncated
    assert decode_entry(data + b"\0", NS, 7, PAYLOAD) is None
    assert decode_entry(data, namespace("other", "weights", "compute"), 7, PAYLOAD) is None
    assert decode_entry(data, NS, 8, PAYLOAD) is None  # another block's key
    assert decode_entry(data, NS, 7, PAYLOAD - 16) is None  # another layout's size


def test_namespaces_differ_by_layout_weights_and_compute():
    names = {namespace(a, b, c) for a in ("l1", "l2") for b in ("w1", "w2")
             for c in ("c1", "c2")}
    assert len(names) == 8


# -- host RAM ---------------------------------------------------------------------------------
def test_tier_counters_add_up_across_threads():
    """The engine's lookups and the load and store threads count into one TierStats."""
    import threading

    from engine_core.kv_offload.tiers import TierStats

    stats = TierStats()

    def work():
        for _ in range(20_000):
            stats.count("misses")
            stats.count("bytes_loaded", 3)
            stats.observe_store(0.001)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (stats.misses, stats.bytes_loaded) == (80_000, 240_000)
    assert sum(stats.store_counts) == 80_000


def test_host_tier_evicts_least_recently_used_within_its_budget():
    size = HEADER_NBYTES + PAYLOAD
    tier = HostTier(3 * size)
    for seed in range(3):
        assert tier.put(*entry(seed))
    assert tier.get(entry_key(NS, 0)) is not None  # 0 is now the most recent
    tier.put(*entry(3))
    assert tier.has([entry_key(NS, s) for s in range(4)]) == [True, False, True, True]
    assert tier.used_bytes == 3 * size and tier.stats.evictions == 1


# -- disk -------------------------------------------------------------------------------------
def test_disk_tier_stores_atomically_and_evicts_oldest_first(tmp_path):
    size = HEADER_NBYTES + PAYLOAD
    tier = DiskTier(tmp_path, 4 * size, NS.hex())
    for seed in range(4):
        assert tier.put(*entry(seed))
        time.sleep(0.01)
    assert bytes(tier.get(entry_key(NS, 0))) == joined(entry(0)[1])  # touched: now newest
    tier.put(*entry(4))
    assert tier.has([entry_key(NS, s) for s in range(5)]) == [True, False, True, True, True]
    assert tier.stats.evictions == 1 and tier.used_bytes == 4 * size
    files = sorted(p.name for p in (tmp_path / NS.hex()).rglob("*") if p.is_file())
    assert len(files) == 4 and all(f.endswith(".kv") for f in files)  # no temporaries left


def test_disk_tier_warm_restart_keeps_entries_in_their_age_order(tmp_path):
    size = HEADER_NBYTES + PAYLOAD
    first = DiskTier(tmp_path, 3 * size, NS.hex())
    for seed in range(3):
        first.put(*entry(seed))
        time.sleep(0.01)
    first.get(entry_key(NS, 0))  # touches the file's time
    (tmp_path / NS.hex() / "00").mkdir(exist_ok=True)
    stale = tmp_path / NS.hex() / "00" / ".tmp.left-by-a-crash"
    stale.write_bytes(b"half an entry")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    second = DiskTier(tmp_path, 3 * size, NS.hex())  # a restart
    assert second.used_bytes == 3 * size and not stale.exists()
    assert bytes(second.get(entry_key(NS, 2))) == joined(entry(2)[1])
    second.put(*entry(3))  # evicts the oldest: 1 (0 was touched, 2 read)
    assert second.has([entry_key(NS, s) for s in range(4)]) == [True, False, True, True]


def test_two_processes_share_a_directory(tmp_path):
    """An entry another process wrote is a hit; its eviction of ours is a miss, not an error;
    and a budget counts both processes' entries once the index is rescanned."""
    size = HEADER_NBYTES + PAYLOAD
    ours = DiskTier(tmp_path, 100 * size, NS.hex(), rescan_s=0.0)
    ours.put(*entry(1))
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.engine_core.test_kv_offload_tiers import entry, NS
        from engine_core.kv_offload.tiers import DiskTier
        t = DiskTier({str(tmp_path)!r}, 100 * {size}, NS.hex())
        t.put(*entry(2))
        t.discard(entry(1)[0])
        print(t.identity())
    """)
    done = subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                          capture_output=True, text=True)
    # one identity for the directory, whichever process asks first; another directory's
    # differs, and this process's memory is nobody's to share
    assert done.stdout.split()[-1] == ours.identity() is not None
    assert DiskTier(tmp_path / "other", size, NS.hex()).identity() != ours.identity()
    assert HostTier(size).identity() is None
    assert bytes(ours.get(entry_key(NS, 2))) == joined(entry(2)[1])
    assert ours.get(entry_key(NS, 1)) is None and ours.stats.errors == 0
    small = DiskTier(tmp_path, size, NS.hex(), rescan_s=0.0)
    small.put(*entry(3))  # over budget: the rescan sees 2 and 3, evicts 2
    assert small.has([entry_key(NS, 2), entry_key(NS, 3)]) == [False, True]


_IN_A_MOUNT_NAMESPACE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.engine_core.test_kv_offload_tiers import entry, NS
from engine_core.kv_offload.tiers import DiskTier
out = {}
full = DiskTier(sys.argv[2], 1 << 30, NS.hex())
out["full_puts"] = [full.put(*entry(s)) for s in range(12)]
out["full_has"] = full.has([entry(s)[0] for s in range(12)])
out["full_errors"] = full.stats.errors
out["full_get_ok"] = full.get(entry(0)[0]) is not None
ro = DiskTier(sys.argv[3], 1 << 30, NS.hex())
out["ro_put"] = ro.put(*entry(1))
out["ro_get"] = ro.get(entry(1)[0])
out["ro_errors"] = ro.stats.errors
out["ro_identity"] = ro.identity()
print(json.dumps(out))
"""


def test_a_full_disk_and_a_read_only_directory_are_misses(tmp_path):
    """In a mount namespace of its own (gone with the child): a 32 KiB tmpfs fills up after a
    few entries, and a read-only bind mount refuses every write; each is a skipped store or a
    miss, counted, never an exception."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "child.py"
    script.write_text(_IN_A_MOUNT_NAMESPACE)
    command = (f"mount -t tmpfs -o size=32k tmpfs {full} && mount --bind {ro} {ro} && "
               f"mount -o remount,bind,ro {ro} && exec {sys.executable} {script} {root} "
               f"{full} {ro}")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", command],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "unshare" in done.stderr and "Operation not permitted" in \
            done.stderr:
        pytest.skip(f"needs a mount namespace of its own (root): {done.stderr}")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["full_puts"][0] is True and False in out["full_puts"]
    assert out["full_has"] == out["full_puts"]  # what failed left nothing behind
    assert out["full_errors"] == out["full_puts"].count(False) and out["full_get_ok"]
    assert out["ro_put"] is False and out["ro_get"] is None and out["ro_errors"] >= 1
    assert out["ro_identity"] is None  # nothing there to share: not counted as shared
    assert "served as a miss" in done.stderr  # logged, once a minute at most
    assert done.stderr.count("kv offload tier disk") <= 2  # one per tier, not one per call
    assert not any(p.name.startswith(".tmp") for p in full.rglob("*"))  # ours, unmounted


# -- redis ------------------------------------------------------------------------------------
def test_redis_tier_budget_and_a_killed_server(tmp_path):
    size = HEADER_NBYTES + PAYLOAD
    with run_redis(tmp_path) as server:
        tier = RedisTier(server.url, 3 * size, NS.hex())
        for seed in range(3):
            assert tier.put(*entry(seed))
        assert bytes(tier.get(entry_key(NS, 0))) == joined(entry(0)[1])  # most recent now
        assert tier.put(*entry(3))
        assert tier.has([entry_key(NS, s) for s in range(4)]) == [True, False, True, True]
        assert tier.stats.evictions == 1 and tier.used_bytes == 3 * size
        other = RedisTier(server.url, 3 * size, NS.hex())  # another host, same namespace
        assert bytes(other.get(entry_key(NS, 3))) == joined(entry(3)[1])
        tier.discard(entry_key(NS, 3))
        assert other.has([entry_key(NS, 3)]) == [False]
        # the same server and namespace: one identity; another namespace has its own
        assert tier.identity() == other.identity() is not None
        assert RedisTier(server.url, size, "another").identity() != tier.identity()
        server.proc.kill()
        server.proc.wait()
        t0 = time.monotonic()
        assert tier.get(entry_key(NS, 2)) is None
        assert tier.put(*entry(5)) is False
        assert tier.has([entry_key(NS, 2)]) == [False]
        assert time.monotonic() - t0 < 3.0  # quiet after the first failure, no retry storm
        assert tier.stats.errors == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_the_store_thread_yields_the_cpu_and_the_load_thread_does_not(tmp_path):
    """Stores are background work: their thread runs STORE_THREAD_NICE below the process (a
    prefill worker's stores must not take its neighbour decode worker's core); a load, which
    a request waits for, keeps the process's priority."""
    import threading

    import torch

    from engine_core.kv_offload.offloader import STORE_THREAD_NICE, KVOffloader
    from engine_core.platforms import select_platform

    kv = torch.zeros(2, 4, 2, 16, 1, 8)
    off = KVOffloader([HostTier(1 << 20)], kv, NS, max_pinned=2, platform=select_platform("cpu"))
    try:
        ids = {t.name: t.native_id for t in threading.enumerate()
               if t.name.startswith("kv-offload-")}
        base = os.getpriority(os.PRIO_PROCESS, 0)
        want = min(19, base + STORE_THREAD_NICE)
        deadline = time.monotonic() + 5  # the thread sets it as it starts
        while (os.getpriority(os.PRIO_PROCESS, ids["kv-offload-store"]) != want
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, ids["kv-offload-store"]) == want
        assert os.getpriority(os.PRIO_PROCESS, ids["kv-offload-load"]) == base
        assert off.capacity_blocks == (1 << 20) // (kv[:, 0].numel() * 4 + 48)
    finally:
        off.close()
