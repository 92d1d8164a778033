"""GPU telemetry through NVML (`nvidia-ml-py`, module `pynvml`), read at scrape time.

Without a GPU or its driver NVML fails to initialize: the collector then exports nothing and
says so once at debug level (a CPU machine is not an error). Units follow Prometheus practice
(bytes, watts, fractions 0-1); DCGM's exporter offers the same quantities under DCGM_FI_* names.
"""

from __future__ import annotations

import logging

from prometheus_client.core import GaugeMetricFamily

from service_infra.metrics.names import PREFIX

logger = logging.getLogger(__name__)


class GPUCollector:
    def __init__(self, nvml=None) -> None:
        self._nvml = nvml  # the pynvml module (injectable for tests)
        self._is_ready: bool | None = None  # None: not tried yet

    def _init(self) -> bool:
        if self._is_ready is None:
            try:
                if self._nvml is None:
                    import pynvml

                    self._nvml = pynvml
                self._nvml.nvmlInit()
                self._is_ready = True
            except Exception as e:  # no driver / no GPU: NVMLError_LibraryNotFound and kin
                logger.debug("no GPU telemetry: NVML unavailable (%s)", e)
                self._is_ready = False
        return self._is_ready

    def collect(self):
        if not self._init():
            return
        nvml = self._nvml
        families = {
            "util": GaugeMetricFamily(PREFIX + "gpu_utilization_perc", "Fraction of time a "
                                      "kernel ran over NVML's last sample period, 0-1.",
                                      labels=["gpu", "uuid"]),
            "used": GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory in use.",
                                      labels=["gpu", "uuid"]),
            "total": GaugeMetricFamily(PREFIX + "gpu_memory_total_bytes", "GPU memory.",
                                       labels=["gpu", "uuid"]),
            "power": GaugeMetricFamily(PREFIX + "gpu_power_watts", "Power draw, watts.",
                                       labels=["gpu", "uuid"]),
        }
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                labels = [str(i), uuid]
                families["util"].add_metric(
                    labels, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                families["used"].add_metric(labels, float(memory.used))
                families["total"].add_metric(labels, float(memory.total))
                families["power"].add_metric(labels,
                                             nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
        except Exception as e:  # a GPU that fell off the bus must not break the scrape
            logger.warning("NVML query failed: %s", e)
        yield from families.values()
