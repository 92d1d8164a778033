"""A prefill or decode worker's metrics, served on its --metrics-port at /metrics.

Pool state (running, waiting, reserved, KV usage) and the engine's counters (prefix cache,
preemptions, iteration sizes, speculative acceptance, lease outcomes) are read from the engine
at scrape time, from the HTTP server's thread: plain integer reads of state the engine thread
updates, each consistent on its own (a scrape may see two counters one step apart). KV
transfers are observed by the prefill worker as each one commits or fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine_core.kv_offload.tiers import TIME_BUCKETS
from engine_core.stats import ITERATION_TOKENS_BUCKETS
from kv_transfer import transports
from service_infra.metrics.autoscaling import AutoscalingCollector
from service_infra.metrics.gpu import GPUCollector
from service_infra.metrics.http import serve_metrics
from service_infra.metrics.names import KV_TRANSFER_BYTES_BUCKETS, KV_TRANSFER_TIME_BUCKETS, PREFIX

logger = logging.getLogger(__name__)


class EngineCollector:
    """Gauges and counters of one engine (and, on a decode worker, its lease table)."""

    def __init__(self, pool: str, model_name: str, engine, lease_table=None) -> None:
        self.labels = [model_name, pool]
        self.engine = engine
        self.leases = lease_table

    def _family(self, cls, name: str, doc: str, value, extra: dict[str, str] | None = None):
        extra = extra or {}
        family = cls(PREFIX + name, doc, labels=["model_name", "pool", *extra])
        family.add_metric([*self.labels, *extra.values()], value)
        return family

    def collect(self):
        eng, g, c = self.engine, GaugeMetricFamily, CounterMetricFamily
        sched, kv = eng.scheduler, eng.kv
        block_size = eng.layout.block_size
        yield self._family(g, "num_requests_running", "Requests in the running batch.",
                           sched.num_running)
        yield self._family(g, "num_requests_waiting", "Requests queued for their first step.",
                           sched.num_waiting)
        yield self._family(g, "num_requests_reserved", "Requests holding reserved blocks while "
                           "their prompt KV is in flight (decode workers).", len(sched.reserved))
        yield self._family(g, "kv_cache_usage_perc", "Fraction of KV blocks in use (held by "
                           "a running request or reserved for a prompt in flight), 0-1.",
                           kv.usage)
        yield self._family(g, "cache_config_info", "KV cache configuration (value 1).", 1,
                           {"block_size": str(block_size), "num_blocks": str(kv.pool.num_blocks),
                            "cache_dtype": str(eng.layout.dtype).removeprefix("torch.")})
        yield self._family(g, "weights_info", "How the weights are held and multiplied "
                           "(value 1): dtype, prefill_weights (dense copies, or the GGUF's "
                           "4/8-bit blocks for every row), decode_activations (none: dense "
                           "decode rows).", 1,
                           {"dtype": str(eng.dtype).removeprefix("torch."),
                            "prefill_weights": eng.prefill_weights,
                            "decode_activations": eng.decode_activations or "none"})
        yield self._family(c, "prefix_cache_queries", "Prompt tokens looked up in the prefix "
                           "cache (whole blocks).", kv.pool.num_cache_queries * block_size)
        yield self._family(c, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           kv.pool.num_cache_hits * block_size)
        yield self._family(c, "num_preemptions", "Requests preempted (KV recomputed later).",
                           sched.num_preemptions)
        yield from self._iterations()
        if eng.spec is not None:
            yield from self._speculative(eng.spec.stats)
        if eng.offloader is not None:
            yield from self._offload(eng.offloader)
        if self.leases is not None:
            yield self._family(g, "kv_leases_active", "Leases holding reserved blocks.",
                               len(self.leases.leases()))
            ended = c(PREFIX + "kv_leases_ended", "Leases ended, by final state (CLAIMED: "
                      "decoded; FAILED, ABORTED, EXPIRED: blocks freed).",
                      labels=["model_name", "pool", "state"])
            counts = self.leases.num_ended
            for state in ("CLAIMED", "FAILED", "ABORTED", "EXPIRED"):
                ended.add_metric([*self.labels, state], counts.get(state, 0))
            yield ended

    def _iterations(self):
        stats = self.engine.stats
        counts = list(stats.iteration_tokens_counts)
        buckets, total = [], 0
        for edge, n in zip([*map(str, ITERATION_TOKENS_BUCKETS), "+Inf"], counts, strict=True):
            total += n
            buckets.append((edge, total))
        h = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens computed per "
                                  "engine step.", labels=["model_name", "pool"])
        h.add_metric(self.labels, buckets, stats.iteration_tokens_sum)
        yield h
        for name, doc, value in (
                ("engine_prompt_tokens", "Prompt tokens computed by this engine.",
                 stats.num_prompt_tokens),
                ("engine_generation_tokens", "Tokens sampled by this engine.",
                 stats.num_generation_tokens),
                ("engine_forks", "Requests that shared another sample's prompt KV (n > 1) "
                 "instead of computing it.", self.engine.scheduler.num_forks)):
            yield self._family(CounterMetricFamily, name, doc, value)
        mask = self.engine.runner.mask_timer
        for name, doc, value in (
                ("grammar_mask_steps", "Engine steps that built structured-output token "
                 "masks.", mask.num_steps),
                ("grammar_mask_seconds", "Seconds spent building structured-output token "
                 "masks (on the mask thread, overlapped with the forward).", mask.seconds)):
            yield self._family(CounterMetricFamily, name, doc, value)
        graphs = self.engine.runner.graphs
        yield self._family(CounterMetricFamily, "decode_graph_replays", "Decode steps "
                           "replayed from a CUDA graph (0: eager, see --enforce-eager).",
                           graphs.num_replays if graphs is not None else 0)

    def _offload(self, off):
        """The offload tiers' counters, one series per tier (engine_core/kv_offload/)."""
        labels = ["model_name", "pool", "tier"]
        for name, doc, attr in (
                ("kv_offload_hits", "KV blocks loaded from an offload tier.", "hits"),
                ("kv_offload_misses", "KV blocks looked for in an offload tier and not there "
                 "(or unreachable).", "misses"),
                ("kv_offload_stores", "KV blocks stored in an offload tier.", "stores"),
                ("kv_offload_evictions", "Entries an offload tier evicted for its budget.",
                 "evictions"),
                ("kv_offload_corrupt", "Entries found torn, truncated or corrupt (served as "
                 "misses and dropped).", "corrupt"),
                ("kv_offload_errors", "Failed reads and writes of a tier's store (a full "
                 "disk, an unreachable Redis): misses, never failed requests.", "errors"),
                ("kv_offload_loaded_bytes", "Bytes of KV loaded from an offload tier.",
                 "bytes_loaded")):
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for tier in off.tiers:
                family.add_metric([*self.labels, tier.name], getattr(tier.stats, attr))
            yield family
        used = GaugeMetricFamily(PREFIX + "kv_offload_bytes", "Bytes an offload tier holds "
                                 "(as this worker counts them).", labels=labels)
        for tier in off.tiers:
            used.add_metric([*self.labels, tier.name], tier.used_bytes)
        yield used
        for name, doc, counts, total in (
                ("kv_offload_load_seconds", "Time to load one request's blocks from a tier.",
                 "load_counts", "load_seconds"),
                ("kv_offload_store_seconds", "Time to store one block in a tier.",
                 "store_counts", "store_seconds")):
            h = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            for tier in off.tiers:
                buckets, cum = [], 0
                edges = [*map(str, TIME_BUCKETS), "+Inf"]
                for edge, n in zip(edges, getattr(tier.stats, counts), strict=True):
                    cum += n
                    buckets.append((edge, cum))
                h.add_metric([*self.labels, tier.name], buckets, getattr(tier.stats, total))
            yield h
        yield self._family(CounterMetricFamily, "kv_offload_store_skipped", "Published KV "
                           "blocks not stored: the pool evicted them while the store queue "
                           "was full.", off.num_store_skipped)

    def _speculative(self, spec):
        c = CounterMetricFamily
        drafts, accepted = list(spec.num_drafts), list(spec.num_accepted)
        yield self._family(c, "spec_decode_num_drafts", "Request-steps verified with drafts.",
                           spec.num_steps)
        yield self._family(c, "spec_decode_num_draft_tokens", "Draft tokens proposed.",
                           sum(drafts))
        yield self._family(c, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                           sum(accepted))
        for name, doc, values in (
                ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft "
                 "position (0 = first).", accepted),
                ("spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed, by draft "
                 "position (0 = first).", drafts)):
            family = c(PREFIX + name, doc, labels=["model_name", "pool", "position"])
            for pos, value in enumerate(values):
                family.add_metric([*self.labels, str(pos)], value)
            yield family


class KVTransferMetrics:
    """Observed by the sender (prefill worker) once per transfer, labelled by transport."""

    TRANSPORTS = transports.names()  # the registry's (tests' transports are not offered)

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "transport"]
        self.seconds = Histogram(PREFIX + "kv_transfer_time_seconds", "Transfer begin -> "
                                 "commit verified by the receiver, seconds.", labels,
                                 buckets=KV_TRANSFER_TIME_BUCKETS, registry=registry)
        self.bytes = Histogram(PREFIX + "kv_transfer_bytes", "KV bytes shipped per transfer.",
                               labels, buckets=KV_TRANSFER_BYTES_BUCKETS, registry=registry)
        self.failures = Counter(PREFIX + "kv_transfer_failures", "Transfers that failed, by "
                                "reason (the receiver's status code, or 'connect').",
                                ["model_name", "transport", "reason"], registry=registry)
        for transport in self.TRANSPORTS:  # series exist before the first transfer
            self.seconds.labels(model_name, transport)
            self.bytes.labels(model_name, transport)
        self.transport_info = Gauge(
            PREFIX + "kv_transport_info", "1 for each (prefill, decode) pair's connection, "
            "labelled by the transport its handshake chose (auto may pick shm, cuda_ipc or "
            "grpc) and where its LayerDone and Commit go (control: unix, the decode worker's "
            "same-host socket, or grpc); fallback_from: the one-sided transport auto chose "
            "by the host ids but could not map here (no shared /dev/shm: pods of one node), "
            "else empty; prefill is its worker id or address, decode the decode worker's "
            "address.",
            ["model_name", "transport", "control", "fallback_from", "prefill", "decode"],
            registry=registry)
        self.prefill = ""  # this worker's name (set once its port is bound: set_prefill)
        # decode -> (transport, control, fallback_from)
        self._chosen: dict[str, tuple[str, str, str]] = {}
        self._active: Callable[[], dict[str, int]] = dict  # by transport (count_active_by)
        registry.register(self)  # collect(): the in-flight gauge, read at scrape time

    def count_active_by(self, active: Callable[[], dict[str, int]]) -> None:
        """Where kv_transfers_active is read: a function giving the transfers begun and not
        yet ended, by transport (called on the scrape's thread)."""
        self._active = active

    def collect(self):
        g = GaugeMetricFamily(PREFIX + "kv_transfers_active", "Transfers begun (Begin sent) "
                              "and not yet ended: layers still being sent, or committed and "
                              "waiting for the receiver's verdict.",
                              labels=["model_name", "transport"])
        active = self._active()
        for transport in sorted({*self.TRANSPORTS, *active}):
            g.add_metric([self.model_name, transport], active.get(transport, 0))
        yield g

    def set_prefill(self, name: str) -> None:
        """This prefill worker's name in the `prefill` label (its worker id or address)."""
        for decode, chosen in self._chosen.items():  # (none before the first request)
            self.transport_info.remove(self.model_name, *chosen, self.prefill, decode)
            self.transport_info.labels(self.model_name, *chosen, name, decode).set(1)
        self.prefill = name

    def connected(self, decode: str, transport: str, control: str,
                  fallback_from: str = "") -> None:
        """A handshake with `decode` chose `transport` and `control` (after `fallback_from`
        could not map, if set); replaces its previous series."""
        old = self._chosen.pop(decode, None)
        if old is not None:
            self.transport_info.remove(self.model_name, *old, self.prefill, decode)
        self._chosen[decode] = (transport, control, fallback_from)
        self.transport_info.labels(self.model_name, transport, control, fallback_from,
                                   self.prefill, decode).set(1)

    def transferred(self, transport: str, seconds: float, num_bytes: int) -> None:
        self.seconds.labels(self.model_name, transport).observe(seconds)
        self.bytes.labels(self.model_name, transport).observe(num_bytes)

    def failed(self, transport: str, reason: str) -> None:
        self.failures.labels(self.model_name, transport, reason or "unknown").inc()


def worker_registry(pool: str, model_name: str, engine, lease_table=None) -> CollectorRegistry:
    """The registry of one worker process: its engine's collector, its pool's autoscaling
    signals and the GPU collector."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(pool, model_name, engine, lease_table))
    registry.register(AutoscalingCollector(pool, model_name, engine))
    registry.register(GPUCollector())
    return registry


def start_metrics(registry: CollectorRegistry, role: str, args) -> int | None:
    """Serve /metrics on args.host:args.metrics_port (0: any free port) from a daemon thread
    and print where ("METRICS <role> http://host:port/metrics"); None if --metrics-port is
    not given."""
    if args.metrics_port is None:
        return None
    port = serve_metrics(registry, args.host, args.metrics_port).server_port
    print(f"METRICS {role} http://{args.host}:{port}/metrics", flush=True)
    return port
