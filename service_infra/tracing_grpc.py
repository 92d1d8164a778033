"""gRPC interceptors of service_infra/tracing.py (imported only when tracing is on): CLIENT
spans that carry the W3C trace context to the callee in the call's metadata, and SERVER spans
that continue it. Span names follow OpenTelemetry's RPC conventions (the full method,
`pdserve.internal.Decode/Reserve`), with rpc.system, rpc.service and rpc.method."""

from __future__ import annotations

import asyncio
import inspect

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode


def _attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


async def _end_after(span, call) -> None:
    code = await call.code()
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def start_client_span(tracer, method: str):
    """(span, carrier): a CLIENT span under the current span and its context to send, for a
    call carried in a stream's message; (None, {}) when no span is current."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None, {}
    span = tracer.start_span(method, kind=SpanKind.CLIENT, attributes=_attributes(method))
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier


def start_server_span(tracer, method: str, carrier: dict[str, str]):
    """The SERVER span continuing `carrier`, a call that came in a stream's message."""
    return tracer.start_span(method, context=propagate.extract(carrier), kind=SpanKind.SERVER,
                             attributes=_attributes(method))


class _ClientInterceptor:
    """A CLIENT span per call made while a span is current, its context in the metadata."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer

    def _start(self, details: grpc.aio.ClientCallDetails):
        if not trace.get_current_span().get_span_context().is_valid:
            return None, details
        method = details.method.decode() if isinstance(details.method, bytes) \
            else details.method
        span = self.tracer.start_span(method.lstrip("/"), kind=SpanKind.CLIENT,
                                      attributes=_attributes(method))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
        return span, grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                                details.credentials, details.wait_for_ready)

    def _watch(self, span, call) -> None:
        if span is not None:
            call.add_done_callback(
                lambda c: asyncio.get_running_loop().create_task(_end_after(span, c)))


class _UnaryUnary(_ClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        span, details = self._start(details)
        call = await continuation(details, request)
        self._watch(span, call)
        return call


class _UnaryStream(_ClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        span, details = self._start(details)
        call = await continuation(details, request)
        self._watch(span, call)
        return call


def client_interceptors(tracer) -> list:
    return [_UnaryUnary(tracer), _UnaryStream(tracer)]


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span, current while the handler runs, for each unary or server-streaming call
    whose metadata carries a trace context; other calls pass untouched."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if handler is None or "traceparent" not in metadata:
            return handler
        parent = propagate.extract(metadata)
        method = details.method
        tracer = self.tracer

        def span():
            return tracer.start_as_current_span(method.lstrip("/"), context=parent,
                                                kind=SpanKind.SERVER,
                                                attributes=_attributes(method))

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request, context):
                with span():
                    return await behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            behavior = handler.unary_stream

            async def stream(request, context):
                with span():
                    result = behavior(request, context)
                    if inspect.isasyncgen(result):
                        async for message in result:
                            yield message
                    else:  # a handler that writes through the context
                        await result

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer)
        return handler
