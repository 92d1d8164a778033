"""The gateway's trace of a request (service_infra/tracing.py; built only when tracing is on):
a root span per request, current while the backend runs it, so that every worker call made
for it (Reserve, Prefill, Decode, ...) is a CLIENT span below it carrying the trace to the
worker; and when it ends, one child span per phase of its timing breakdown:

    pdserve.request                      arrival -> end
      queue                              arrival -> first scheduled for prefill
      prefill                            -> first token sampled
      kv_transfer                        -> first token delivered by the decode worker
      first_decode_step                  -> second token
      stream                             first token -> end
      pdserve.internal.Decode/Reserve ... (the worker calls, from the interceptors)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from service_infra import tracing
from service_infra.backend import GenerateChunk, GenerateInput, Timing


def traced(backend):
    """`backend` with request spans when tracing is on; `backend` itself when it is off."""
    return TracedBackend(backend) if tracing.is_on() else backend


class TracedBackend:
    """A Backend that traces generate() and hands everything else to the one it wraps
    (attributes are read from and written to the wrapped backend)."""

    def __init__(self, inner) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._inner, name, value)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateChunk]:
        from opentelemetry.trace import SpanKind

        timing: Timing | None = None
        with tracing.tracer().start_as_current_span(
                "pdserve.request", kind=SpanKind.SERVER, start_time=tracing.wall_ns(inp.arrival),
                attributes={"pdserve.request_id": inp.req_id,
                            "pdserve.num_prompt_tokens": len(inp.prompt_token_ids)}) as span:
            async with contextlib.aclosing(self._inner.generate(inp)) as chunks:
                async for chunk in chunks:
                    timing = chunk.timing or timing
                    if chunk.is_last:
                        span.set_attribute("pdserve.finish_reason", chunk.finish_reason)
                        span.set_attribute("pdserve.num_output_tokens",
                                           chunk.num_output_tokens)
                    yield chunk
            if timing is not None:
                _phases(inp.arrival, timing)


def _phases(arrival: float, t: Timing) -> None:
    """The timing breakdown as child spans of the current (the request's) span."""
    first_token = arrival + t.ttft_s
    stretches = [("queue", 0.0, t.queue_s), ("prefill", t.queue_s, t.queue_s + t.prefill_s),
                 ("kv_transfer", t.queue_s + t.prefill_s, t.ttft_s),
                 ("first_decode_step", t.ttft_s, t.ttft_s + t.first_decode_step_s)]
    for name, start, end in stretches:
        tracing.phase(name, arrival + start, arrival + end, **{
            "pdserve.prefill_where": t.prefill_where})
    tracing.phase("stream", first_token, arrival + t.total_s)
