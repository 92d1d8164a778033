"""The gateway's metrics: what clients experience, measured where they connect.

    MeteredBackend(backend, metrics).generate(inp):
        first chunk  -> TTFT (from arrival at the gateway)
        each further chunk -> one ITL observation (one per engine step, as vLLM counts it;
                              a speculative step's chunk carries several tokens)
        last chunk   -> e2e, TPOT, the TTFT breakdown from its Timing, token counts,
                        request_success{finished_reason}
        an error     -> requests_rejected{reason} before the first token,
                        requests_aborted{reason} after it (client gone, deadline, failure)
Validation errors never reach the backend: the APIs report them with `metrics.reject()`.
Latencies are intervals of time.monotonic() in this process only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from service_infra.backend import (
    Backend,
    BackendUnavailable,
    DeadlineExceeded,
    DuplicateRequestError,
    GenerateChunk,
    GenerateInput,
    Overloaded,
)
from service_infra.metrics.names import (
    ITL_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    one_two_five_buckets,
)

# the reasons a request is refused or cut short (bounded label values)
REJECT_REASONS = ("invalid_argument", "unauthenticated", "already_exists", "overloaded",
                  "unavailable", "deadline")
ABORT_REASONS = ("client_disconnected", "deadline", "unavailable", "error")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        label = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets,
                             registry=registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds",
                         "Arrival at the gateway -> first token sent, seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between two token messages of one stream, seconds.", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "(e2e - TTFT) / (output tokens - 1) per request, seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Arrival -> last token, seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Arrival -> first scheduled for prefill (routing, reservation and "
                          "the prefill queue), seconds.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "First scheduled -> first token sampled, seconds.",
                            REQUEST_LATENCY_BUCKETS)
        self.kv_transfer = hist("request_kv_transfer_time_seconds",
                                "First token sampled -> delivered by the decode worker (the "
                                "transfer tail not hidden behind prefill), seconds.",
                                TTFT_BUCKETS)
        self.first_decode_step = hist("request_first_decode_step_time_seconds",
                                      "Joined the decode batch -> second token, seconds.",
                                      TTFT_BUCKETS)
        self.decode = hist("request_decode_time_seconds",
                           "First token -> last token, seconds.", REQUEST_LATENCY_BUCKETS)
        token_buckets = one_two_five_buckets(max_model_len)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.",
                               token_buckets)
        self.output_len = hist("request_generation_tokens", "Generated tokens per request.",
                               token_buckets)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished "
                                     "requests.", label, registry=registry).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         label, registry=registry).labels(model_name)
        self.success = Counter(PREFIX + "request_success",
                               "Requests finished, by finish reason (stop, length, abort).",
                               ["model_name", "finished_reason"], registry=registry)
        self.rejected = Counter(PREFIX + "requests_rejected",
                                "Requests refused before their first token, by reason.",
                                ["model_name", "reason"], registry=registry)
        self.aborted = Counter(PREFIX + "requests_aborted",
                               "Requests cut short after their first token, by reason.",
                               ["model_name", "reason"], registry=registry)
        for reason in REJECT_REASONS:  # present from the start, so rate() sees the first one
            self.rejected.labels(model_name, reason)
        for reason in ABORT_REASONS:
            self.aborted.labels(model_name, reason)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def finished(self, chunk: GenerateChunk, arrival: float, t_first: float, now: float) -> None:
        self.e2e.observe(now - arrival)
        self.decode.observe(now - t_first)
        if chunk.num_output_tokens > 1:
            self.tpot.observe((now - t_first) / (chunk.num_output_tokens - 1))
        if chunk.timing is not None:
            t = chunk.timing
            self.queue.observe(t.queue_s)
            self.prefill.observe(t.prefill_s)
            self.kv_transfer.observe(t.kv_transfer_s)
            self.first_decode_step.observe(t.first_decode_step_s)
        self.prompt_len.observe(chunk.num_prompt_tokens)
        self.output_len.observe(chunk.num_output_tokens)
        self.prompt_tokens.inc(chunk.num_prompt_tokens)
        self.success.labels(self.model_name, chunk.finish_reason).inc()


def _error_reason(e: BaseException) -> str:
    if isinstance(e, DeadlineExceeded):
        return "deadline"
    if isinstance(e, Overloaded):
        return "overloaded"
    if isinstance(e, DuplicateRequestError):
        return "already_exists"
    if isinstance(e, ValueError):
        return "invalid_argument"
    if isinstance(e, BackendUnavailable):
        return "unavailable"
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return "client_disconnected"
    return "error"


class MeteredBackend:
    """A Backend that measures every stream of the backend it wraps."""

    def __init__(self, backend: Backend, metrics: GatewayMetrics,
                 registry: CollectorRegistry) -> None:
        self.inner = backend
        self.metrics = metrics
        self.num_streams = 0
        self.num_requests = 0  # streams begun since start (this process's)
        self.api_server_index: int | None = None  # which of --api-servers this is (None: one)
        self.collector = _GatewayCollector(self)
        registry.register(self.collector)

    @property
    def model(self):
        return self.inner.model

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateChunk]:
        m = self.metrics
        t_first = t_last = None
        is_finished = False  # a consumer closing us after the last chunk is no abort
        self.num_streams += 1
        self.num_requests += 1
        try:
            async for chunk in self.inner.generate(inp):
                now = time.monotonic()
                if t_first is None:
                    if chunk.token_ids:
                        t_first = now
                        m.ttft.observe(now - inp.arrival)
                elif chunk.token_ids:
                    m.itl.observe(now - t_last)
                if chunk.token_ids:
                    t_last = now
                    m.generation_tokens.inc(len(chunk.token_ids))
                if chunk.is_last:
                    is_finished = True
                    m.finished(chunk, inp.arrival, t_first or now, now)
                yield chunk
        except BaseException as e:
            if is_finished:
                raise
            reason = _error_reason(e)
            if t_first is None and reason != "client_disconnected":
                m.reject(reason)
            else:
                m.aborted.labels(m.model_name, reason if reason in ABORT_REASONS
                                 else "error").inc()
            raise
        finally:
            self.num_streams -= 1

    async def abort(self, req_id: str) -> bool:
        return await self.inner.abort(req_id)

    async def status(self) -> dict[str, Any]:
        out = await self.inner.status()
        out["num_requests"] = self.num_requests  # this process's (one of --api-servers)
        out["api_server"] = self.api_server_index
        return out

    async def close(self) -> None:
        await self.inner.close()


class _GatewayCollector:
    """Gauges read at scrape time: streams in flight, requests waiting for decode room and,
    in disaggregated mode, healthy workers per pool (from the gateway's last status refresh)."""

    def __init__(self, metered: MeteredBackend) -> None:
        self.metered = metered

    def collect(self):
        name = self.metered.metrics.model_name
        running = GaugeMetricFamily(PREFIX + "num_requests_running",
                                    "Requests running (gateway: streams in flight).",
                                    labels=["model_name", "pool"])
        running.add_metric([name, "gateway"], self.metered.num_streams)
        waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting",
                                    "Requests waiting (gateway: for a decode worker with room).",
                                    labels=["model_name", "pool"])
        inner = self.metered.inner
        waiting.add_metric([name, "gateway"], getattr(inner, "num_admission_waiting", 0))
        yield running
        yield waiting
        pools = {"prefill": getattr(inner, "prefill", None), "decode": getattr(inner, "decode",
                                                                               None)}
        migrations = getattr(inner, "num_migrations", None)
        if migrations is not None:
            moved = CounterMetricFamily(PREFIX + "request_migrations", "Requests run again "
                                        "after losing a worker, by the pool that was lost "
                                        "(prefill: re-prefilled; decode: continued elsewhere).",
                                        labels=["model_name", "pool"])
            for pool, n in migrations.items():
                moved.add_metric([name, pool], n)
            yield moved
        decisions = getattr(inner, "num_prefill_decisions", None)
        if decisions is not None:
            placed = CounterMetricFamily(PREFIX + "prefill_decisions", "Where prompts were "
                                         "prefilled (local: the decode worker; remote: the "
                                         "prefill pool) and why (gateway/disagg/prefill_policy.py).",
                                         labels=["model_name", "where", "reason"])
            for (where, reason), n in sorted(decisions.items()):
                placed.add_metric([name, where, reason], n)
            yield placed
        canary = getattr(inner, "canary_monitor", None)
        if canary is not None and canary.config.is_on:
            yield from _canary_families(name, canary.state)
        if pools["decode"] is not None:
            healthy = GaugeMetricFamily(PREFIX + "healthy_workers",
                                        "Workers that answered the last status refresh.",
                                        labels=["model_name", "pool"])
            for pool, workers in pools.items():
                healthy.add_metric([name, pool], sum(w.is_healthy for w in workers or ()))
            yield healthy


def _canary_families(name: str, state):
    """The canary's verdicts (gateway/disagg/canary.py): latency, failures, last success, ready."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    for cls, metric, doc, value in (
            (g, "canary_latency_seconds", "Seconds the last successful canary took (Reserve, "
             "Prefill, KV transfer, Decode of one token).", state.last_latency_s),
            (g, "canary_last_success_timestamp_seconds", "Unix time of the last successful "
             "canary.", state.last_success),
            (g, "canary_ready", "1 while the canary keeps readiness SERVING.",
             float(state.is_ready))):
        family = cls(PREFIX + metric, doc, labels=["model_name"])
        if value is not None:
            family.add_metric([name], value)
        yield family
    failures = c(PREFIX + "canary_failures", "Canaries that failed, by reason (timeout, "
                 "or the error of the step that failed).", labels=["model_name", "reason"])
    for reason, n in sorted(state.num_failures.items()):
        failures.add_metric([name, reason], n)
    yield failures
