"""NVML telemetry (service_infra/metrics/gpu.py) read from the real card: the collector's
figures agree with what CUDA itself reports. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from service_infra.metrics.gpu import GPUCollector

pytestmark = pytest.mark.gpu


def samples() -> dict[str, float]:
    """GPU 0's value of each pdserve:gpu_* gauge."""
    return {s.name.split(":", 1)[1]: s.value for family in GPUCollector().collect()
            for s in family.samples if s.labels["gpu"] == "0"}


def test_nvml_gauges_match_the_card():
    pytest.importorskip("pynvml")
    _, total = torch.cuda.mem_get_info(0)
    before = samples()
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB more in use
    torch.cuda.synchronize()
    got = samples()
    import pynvml

    pynvml.nvmlInit()
    try:
        mig = pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0))[0] == 1
    except pynvml.NVMLError:  # a card without MIG
        mig = False
    # under MIG, NVML reads the whole card (no utilization), CUDA sees its slice
    want = {"gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_power_watts"}
    assert set(got) == want | (set() if mig else {"gpu_utilization_perc"})
    if mig:
        assert got["gpu_memory_total_bytes"] >= total
    else:
        assert got["gpu_memory_total_bytes"] == pytest.approx(total, rel=0.02)
    grew = got["gpu_memory_used_bytes"] - before["gpu_memory_used_bytes"]
    assert grew >= 0.9 * held.numel()
    assert 0.0 <= got.get("gpu_utilization_perc", 0.0) <= 1.0
    assert 10.0 < got["gpu_power_watts"] < 2000.0  # an idle H100/H200 draws ~70-120 W
