"""The shared-memory KV pool: shared pages, identity checks, and no files left behind by a
process killed with SIGKILL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from kv_helpers import LAYOUTS

from kv_transfer import SharedKVPool, TransportRefusedError, reap_stale_pools

REPO = Path(__file__).resolve().parents[2]
LAYOUT = LAYOUTS[1]


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="pdserve-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_attached_pool_shares_pages_with_the_owner(shm_dir):
    with SharedKVPool.create(LAYOUT, 6, directory=shm_dir) as owner:
        assert owner.tensor.shape == LAYOUT.cache_shape(6) and owner.is_owner
        assert not owner.tensor.any()  # created zeroed
        peer = SharedKVPool.attach(owner.path, LAYOUT, 6, identity=owner.identity)
        assert not peer.is_owner
        peer.tensor[2, 5].fill_(1.5)
        assert torch.equal(owner.tensor[2, 5], torch.full_like(owner.tensor[2, 5], 1.5))
        peer.close()  # an attacher's close never unlinks
        assert os.path.exists(owner.path)
    assert not os.path.exists(owner.path)
    with pytest.raises(TransportRefusedError, match="must share /dev/shm"):
        SharedKVPool.attach(owner.path, LAYOUT, 6)


def test_attach_refuses_another_file_or_another_size(shm_dir):
    with SharedKVPool.create(LAYOUT, 6, directory=shm_dir) as owner:
        dev, ino = owner.identity
        with pytest.raises(TransportRefusedError, match="separate /dev/shm mounts"):
            SharedKVPool.attach(owner.path, LAYOUT, 6, identity=(dev, ino + 1))
        with pytest.raises(TransportRefusedError, match="the layout needs"):
            SharedKVPool.attach(owner.path, LAYOUT, 7)


_OWNER = """
import sys, time
from engine_core.kv_cache.layout import KVLayout
from kv_transfer import SharedKVPool
pool = SharedKVPool.create(KVLayout("tiny", "bfloat16", 8, 4, 3, 64), 6, directory=sys.argv[1])
print(pool.path, flush=True)
time.sleep(60)
"""


def test_files_of_a_killed_owner_are_reaped_and_live_ones_kept(shm_dir):
    child = subprocess.Popen([sys.executable, "-c", _OWNER, shm_dir], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        dead_path = child.stdout.readline().strip()
        assert reap_stale_pools(shm_dir) == []  # its owner is alive: locked
        child.kill()  # SIGKILL: no cleanup runs in the child
        child.wait(timeout=10)
    finally:
        child.kill()
        child.wait()
    assert os.path.exists(dead_path)
    young_tmp = os.path.join(shm_dir, "pdserve-kv-1-0.tmp")  # a pool being created right now
    old_tmp = os.path.join(shm_dir, "pdserve-kv-2-0.tmp")  # a creator killed mid-way
    for path in (young_tmp, old_tmp):
        Path(path).touch()
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    with SharedKVPool.create(LAYOUT, 2, directory=shm_dir) as live:  # create() reaps first
        assert not os.path.exists(dead_path) and not os.path.exists(old_tmp)
        assert os.path.exists(young_tmp)
        assert reap_stale_pools(shm_dir) == [] and os.path.exists(live.path)
