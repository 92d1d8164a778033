"""kernels/huge_pages.py: tensors the C kernels stream, on 2 MiB pages where Linux allows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.kv_cache.layout import KVLayout
from kernels import huge_pages


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return "never"
    return path.read_text().split("[")[1].split("]")[0]


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_values_shape_and_alignment():
    t = huge_pages.zeros((300, 2, 16, 3, 64), torch.bfloat16)  # 3.5 MiB
    assert t.shape == (300, 2, 16, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    src = torch.randn(1024, 1024).permute(1, 0)  # not contiguous
    c = huge_pages.copy(src)
    assert c.is_contiguous() and torch.equal(c, src)
    small = huge_pages.empty((3, 4), torch.float32)  # below a huge page: plain torch.empty
    assert small.shape == (3, 4)


@pytest.mark.skipif(_thp_mode() == "never" or not huge_pages._AVAILABLE,
                    reason="transparent huge pages are off here")
def test_the_kv_cache_is_backed_by_huge_pages():
    layout = KVLayout(model="test", dtype="bfloat16", block_size=16, num_layers=4,
                      num_kv_heads=3, head_dim=64)
    # a freed 30 MiB block raises glibc's mmap threshold above the cache's size, so torch's
    # allocator would now serve it from the heap, possibly already touched (seen in the suite)
    del_me = torch.ones(30 << 20, dtype=torch.uint8)
    del del_me
    cache = layout.allocate(400)  # 4 x 400 blocks x 12 KiB = 18.75 MiB
    assert _anon_huge_kb(cache.data_ptr()) >= 2048
