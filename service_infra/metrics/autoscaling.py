"""Per-pool saturation signals, for autoscalers (Kubernetes HPAs through prometheus-adapter:
helm/prometheus-adapter-values.yaml, docs/operations/autoscaling.md). Each pool exports what tracks its own
bottleneck, so that one pool's saturation does not read as the other's (requests that wait
for a decode worker wait at the gateway, where no worker gauge sees them):

    prefill  pdserve:prefill_queue_tokens        prompt tokens accepted and not computed yet
                                                 (queued, and the rest of those in prefill)
             pdserve:prefill_queue_ttft_seconds  the TTFT that queue implies: those tokens at
                                                 the worker's measured prefill speed (0 until
                                                 its first prefill step measured it)
    decode   pdserve:decode_batch_usage_perc     (running + reserved sequences) / --max-num-seqs:
                                                 what admission counts against the limit, 0-1
             pdserve:kv_cache_usage_perc         (engine gauge, worker.py) KV blocks in use or
                                                 reserved for a prompt in flight / the pool

Read at scrape time from the scheduler the engine thread updates: plain reads, each sequence's
counts consistent on its own (a scrape may see a request one step apart from another).
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from service_infra.metrics.names import PREFIX

# each pool's signals (metric names without the prefix), for the chart's HPAs
SIGNALS = {"prefill": ("prefill_queue_ttft_seconds", "prefill_queue_tokens"),
           "decode": ("decode_batch_usage_perc", "kv_cache_usage_perc")}


def prefill_queue_tokens(scheduler) -> int:
    """Prompt tokens of the waiting and running requests not computed yet."""
    requests = [*list(scheduler.waiting), *list(scheduler.running)]
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in requests)


class AutoscalingCollector:
    """The signals of one worker's pool (`pool`: "prefill" or "decode")."""

    def __init__(self, pool: str, model_name: str, engine) -> None:
        if pool not in ("prefill", "decode"):
            raise ValueError(f"pool must be prefill or decode, got {pool!r}")
        self.pool, self.labels, self.engine = pool, [model_name, pool], engine

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "pool"])
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        sched = self.engine.scheduler
        if self.pool == "prefill":
            tokens = prefill_queue_tokens(sched)
            speed = self.engine.stats.prefill_tokens_per_s
            yield self._gauge("prefill_queue_tokens", "Prompt tokens accepted and not "
                              "computed yet (autoscaling signal of the prefill pool).", tokens)
            yield self._gauge("prefill_queue_ttft_seconds", "Seconds the queued prompt tokens "
                              "take at the measured prefill speed: the TTFT a prompt arriving "
                              "now waits for (0 until the speed is measured).",
                              tokens / speed if speed > 0 else 0.0)
            return
        limit = sched.config.max_num_seqs
        yield self._gauge("decode_batch_usage_perc", "Running and reserved sequences / "
                          "--max-num-seqs, 0-1 (autoscaling signal of the decode pool).",
                          (sched.num_running + sched.num_reserved) / limit)
