"""Metric names and bucket edges, shared by the exporters and the dashboard tests.

Names follow vLLM's (`vllm:` -> `pdserve:`); counters are declared without `_total` and are
exposed as `<name>_total`. Bucket edges are vLLM's, so PromQL written for vLLM ports.
"""

from __future__ import annotations

PREFIX = "pdserve:"

# vllm/v1/metrics/loggers.py bucket edges (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's NIXL connector: transfer time (seconds) and bytes (2 KiB .. 8 GiB, every other power)
KV_TRANSFER_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75,
                            1.0, 5.0)
KV_TRANSFER_BYTES_BUCKETS = tuple(float(2 ** p) for p in range(11, 34, 2))


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count histograms)."""
    out: list[float] = []
    mantissas, exponent = (1, 2, 5), 0
    while True:
        for m in mantissas:
            value = m * 10 ** exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1
