"""GPU telemetry through NVML (`nvidia-ml-py`, module `pynvml`), read at scrape time.

Without a GPU or its driver NVML fails to initialize: the collector then exports nothing and
says so once at debug level (a CPU machine is not an error). A quantity NVML cannot read on a
card (utilization under MIG) is left out for that card alone, said once. `gpu` is NVML's
index, in PCI order whatever CUDA_VISIBLE_DEVICES says; `uuid` names the card. Units follow Prometheus practice
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
        self._unreadable: set[tuple[int, str]] = set()  # (gpu, quantity) said once

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
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            logger.warning("NVML query failed: %s", e)
            count = 0
        for i in range(count):
            try:  # a GPU that fell off the bus must not break the scrape
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
            except Exception as e:
                logger.warning("NVML query of GPU %d failed: %s", i, e)
                continue
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            labels = [str(i), uuid]
            # each quantity alone: a MIG-enabled card answers NotSupported for utilization
            # and still has memory and power to report
            readings = {
                "util": lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
                "used": lambda h: float(nvml.nvmlDeviceGetMemoryInfo(h).used),
                "total": lambda h: float(nvml.nvmlDeviceGetMemoryInfo(h).total),
                "power": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            }
            for key, read in readings.items():
                try:
                    families[key].add_metric(labels, read(handle))
                except Exception as e:
                    if (i, key) not in self._unreadable:
                        self._unreadable.add((i, key))
                        logger.info("GPU %d: NVML cannot read %s (%s); not exported", i,
                                    families[key].name, e)
        yield from families.values()
