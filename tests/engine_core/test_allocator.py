"""Freed heap memory back to the OS (engine_core/weights/allocator.py), in a fresh process:
a hole in glibc's heap stays resident until return_freed_memory() hands it back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_core.weights.allocator import _glibc
from tests.helpers import ROOT

SCRIPT = """
import json
import numpy as np
from engine_core.weights.allocator import return_freed_memory

def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

big = np.ones(2 << 20)  # 16 MiB, freed: glibc serves smaller buffers from its heap after it
del big
hole, top = np.ones(1 << 20), np.ones(1 << 20)  # 8 MiB each, touched
held = rss_kb()
del hole  # a hole below `top`: the heap cannot shrink past it
kept = held - rss_kb()
returned = return_freed_memory()
print(json.dumps({"kept_kb": kept, "returned": returned, "freed_kb": held - rss_kb()}))
"""


@pytest.mark.skipif(_glibc() is None, reason="not glibc")
def test_a_hole_in_the_heap_goes_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["kept_kb"] < 1024, got  # freed, yet resident
    assert got["returned"] and got["freed_kb"] >= 7 * 1024, got
