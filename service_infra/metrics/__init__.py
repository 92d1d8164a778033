"""Prometheus metrics of every pdserve process: vLLM's names, types, buckets and `model_name`
label, with the prefix `pdserve:` (so vLLM dashboards and autoscalers port by a rename).

    names.py    metric names, the `pdserve:` prefix and bucket edges, shared by every exporter
    worker.py   prefill and decode workers: pool gauges (running, waiting, reserved, KV usage),
                prefix cache, preemptions, speculative acceptance, KV transfers and leases;
                served on --metrics-port
    autoscaling.py  each pool's saturation signal for autoscalers (prefill: queued tokens and
                the TTFT they imply; decode: batch usage; with kv_cache_usage_perc)
    gpu.py      NVML telemetry when a GPU is present (nothing, quietly, without one)
    http.py     the workers' /metrics endpoint (text format, whatever the Accept header)
The gateway's own metrics (request latencies, tokens, finishes, rejections, aborts; served on
its HTTP port) live with the gateway, in gateway/metrics.py, on the names defined here.

Each process has one CollectorRegistry. Gauges and engine counters are read at scrape time
from state the processes keep anyway, so the hot path does no metrics work beyond the
histograms observed once per request or transfer.
"""
