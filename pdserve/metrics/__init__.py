"""Prometheus metrics of every pdserve process: vLLM's names, types, buckets and `model_name`
label, with the prefix `pdserve:` (so vLLM dashboards and autoscalers port by a rename).

    gateway.py  the gateway: request latencies (TTFT, ITL, TPOT, e2e and the TTFT breakdown),
                tokens, finishes, rejections and aborts; served on its HTTP port at /metrics
    worker.py   prefill and decode workers: pool gauges (running, waiting, reserved, KV usage),
                prefix cache, preemptions, speculative acceptance, KV transfers and leases;
                served on --metrics-port
    gpu.py      NVML telemetry when a GPU is present (nothing, quietly, without one)

Each process has one CollectorRegistry. Gauges and engine counters are read at scrape time
from state the processes keep anyway, so the hot path does no metrics work beyond the
histograms observed once per request or transfer.
"""
