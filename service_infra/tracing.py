"""OpenTelemetry traces of a request across the gateway, the prefill and the decode worker,
exported over OTLP/gRPC (`--otlp-traces-endpoint URL`, vLLM's flag; off by default).

    setup("prefill", instance_id, endpoint)   once per process, before serving; a no-op
                                              without an endpoint: nothing is imported, the
                                              interceptor lists are empty, nothing else runs
    client_interceptors()   on the gateway's and the prefill worker's worker channels: each
                            call made inside a traced request is a CLIENT span, and carries
                            the W3C trace context (`traceparent`) in its gRPC metadata
    server_interceptors()   on the workers' servers: each call that carries a trace context
                            is a SERVER span, child of the caller's, current while it runs
    start_call(method)      the same two spans for a call multiplexed on a long-lived stream
    continue_call(method,   (Decode.Stream: a request's start message stands for the RPC of
                  carrier)  its name and carries the context in its trace_context field);
    end_call(span, error)   each ends when the request's last entry is sent / read
    phase(name, start, end) a child span of the current one over a stretch measured anyway
                            (time.monotonic() seconds), e.g. a prefill's queue and compute

Each process's resource names it: service.name pdserve-gateway / pdserve-prefill /
pdserve-decode, service.instance.id its worker id (the gateway: POD_NAME, or host and pid).
Calls outside a traced request (Status, the canary's) make no span.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
from typing import Any

logger = logging.getLogger(__name__)

SERVICE_NAMES = {"gateway": "pdserve-gateway", "prefill": "pdserve-prefill",
                 "decode": "pdserve-decode"}
# The RPC each kind of Decode.Stream start message stands for: its spans' name.
STREAM_CALLS = {"reserve": "pdserve.internal.Decode/Reserve",
                "decode": "pdserve.internal.Decode/Decode",
                "prefill_locally": "pdserve.internal.Decode/PrefillLocally",
                "fork": "pdserve.internal.Decode/Fork"}
EXPORT_DELAY_MS = 1000  # spans leave in batches at most this late

_tracer = None  # an opentelemetry Tracer once setup() had an endpoint; None: tracing is off
_provider = None


def add_tracing_argument(p) -> None:
    """--otlp-traces-endpoint, on every server command."""
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces of each request over OTLP/gRPC to this "
                        "collector (http://host:4317; https:// for TLS); default: no tracing, "
                        "at no cost")


def instance_id(args=None) -> str:
    """This process's service.instance.id: --worker-id, POD_NAME, else host and pid."""
    return (getattr(args, "worker_id", None) or os.environ.get("POD_NAME")
            or f"{socket.gethostname()}-{os.getpid()}")


def setup(role: str, instance: str, endpoint: str | None) -> bool:
    """Turn tracing on for this process if `endpoint` is set; whether it is on."""
    global _tracer, _provider
    if not endpoint:
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": SERVICE_NAMES[role],
                                "service.instance.id": instance})
    _provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    _provider.add_span_processor(BatchSpanProcessor(exporter,
                                                    schedule_delay_millis=EXPORT_DELAY_MS))
    _tracer = _provider.get_tracer("pdserve")
    trace.set_tracer_provider(_provider)
    atexit.register(shutdown)
    logger.warning("tracing: spans of %s (%s) go to %s", SERVICE_NAMES[role], instance,
                   endpoint)
    return True


def shutdown() -> None:
    """Export what is left (at exit); a no-op when tracing is off."""
    if _provider is not None:
        _provider.shutdown()


def is_on() -> bool:
    return _tracer is not None


def tracer():
    return _tracer


def wall_ns(t_monotonic: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - t_monotonic) * 1e9)


def phase(name: str, start: float, end: float, parent: Any = None, **attributes: Any) -> None:
    """A finished child span of `parent` (default: the current span), from `start` to `end`
    (time.monotonic() seconds); nothing when tracing is off or there is no parent."""
    if _tracer is None:
        return
    from opentelemetry import trace

    if parent is None:
        if not trace.get_current_span().get_span_context().is_valid:
            return
        context = None
    else:
        context = trace.set_span_in_context(parent)
    span = _tracer.start_span(name, context=context, start_time=wall_ns(start),
                              attributes=attributes)
    span.end(end_time=wall_ns(max(start, end)))


def client_interceptors() -> list:
    """Interceptors for grpc.aio channels to workers ([] when tracing is off)."""
    if _tracer is None:
        return []
    from service_infra.tracing_grpc import client_interceptors as make

    return make(_tracer)


def server_interceptors() -> list:
    """Interceptors for a worker's grpc.aio server ([] when tracing is off)."""
    if _tracer is None:
        return []
    from service_infra.tracing_grpc import ServerInterceptor

    return [ServerInterceptor(_tracer)]



def start_call(method: str) -> tuple[Any, dict[str, str]]:
    """A CLIENT span `method` under the current span, for a call carried in a stream's message,
    and the trace context to send with it; (None, {}) when tracing is off or no span is
    current. End it with end_call()."""
    if _tracer is None:
        return None, {}
    from service_infra.tracing_grpc import start_client_span

    return start_client_span(_tracer, method)


def continue_call(method: str, carrier) -> Any:
    """The SERVER span `method` continuing the caller's context `carrier` (a start message's
    trace_context); None when tracing is off or the message carried none."""
    if _tracer is None or not carrier:
        return None
    from service_infra.tracing_grpc import start_server_span

    return start_server_span(_tracer, method, dict(carrier))


def end_call(span, error: str | None = None) -> None:
    """End a span of start_call() or continue_call() (None: nothing), as failed if `error`."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
