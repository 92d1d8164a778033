"""OpenAI-compatible HTTP API on FastAPI, over a Backend.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models   GET /health (= /health/ready)   GET /health/live   GET /internal/status (counts and free KV blocks)
    GET  /metrics (Prometheus; gateway/metrics.py)

Each generation runs in its own task, watched by a second task that waits for the client's
`http.disconnect`: a client that goes away cancels the generation, which aborts the request in
the backend (service_infra/backend.py), whether it is streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway import openai_protocol as oai
from gateway.auth import APIKeys, bearer_token
from gateway.validation import UnknownModelError, ValidationError
from service_infra.backend import (
    Backend,
    BackendUnavailable,
    DeadlineExceeded,
    GenerateChunk,
    Overloaded,
)

MAX_BODY_BYTES = 4 << 20  # larger request bodies are refused with 400
Parser = Callable[[Any, Backend], Awaitable[oai.OpenAIRequest]]


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _backend_error(e: Exception) -> JSONResponse:
    if isinstance(e, ValidationError):
        if isinstance(e, UnknownModelError):
            return error(404, e.message, e.field, "model_not_found")
        return error(400, e.message, e.field or None)
    if isinstance(e, BackendUnavailable):
        return error(503, str(e), kind="service_unavailable")
    if isinstance(e, DeadlineExceeded):
        return error(504, str(e), kind="timeout")
    if isinstance(e, Overloaded):
        return error(429, str(e), kind="rate_limit_exceeded")
    return error(400, str(e))  # a ValueError from the backend: bad input validation let by


class _Generation:
    """One backend stream pumped by its own task, cancelled when the HTTP client leaves."""

    def __init__(self, backend: Backend, req: oai.OpenAIRequest, request: Request) -> None:
        self.queue: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(backend, req))
        self.watcher = asyncio.create_task(_wait_disconnect(request))
        self.watcher.add_done_callback(lambda _: self.task.cancel())

    async def _pump(self, backend: Backend, req: oai.OpenAIRequest) -> None:
        try:
            async with contextlib.aclosing(backend.generate(req.inp)) as chunks:
                async for chunk in chunks:
                    self.queue.put_nowait(chunk)
        except asyncio.CancelledError:
            self.queue.put_nowait(BackendUnavailable("the client disconnected"))
            raise
        except Exception as e:  # handed to the consumer
            self.queue.put_nowait(e)

    async def chunks(self) -> AsyncIterator[GenerateChunk]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.is_last:
                return

    def close(self) -> None:
        self.task.cancel()
        self.watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ValidationError("body", f"the request body must be at most {MAX_BODY_BYTES} "
                              f"bytes, got {declared}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise ValidationError("body", f"the request body must be at most "
                                  f"{MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValidationError("body", f"the request body is not valid JSON: {e}") from None


def build_app(backend: Backend, is_serving: Callable[[], bool],
              registry: CollectorRegistry | None = None,
              on_reject: Callable[[str], None] = lambda reason: None,
              api_keys: APIKeys | None = None) -> FastAPI:
    """The OpenAI API; also /health, /internal/status and, given a registry, /metrics.
    With API keys, /v1/* needs `Authorization: Bearer <key>` (401 otherwise)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    keys = api_keys or APIKeys()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if request.url.path.startswith("/v1/") and not keys.admits(
                bearer_token(request.headers.get("authorization"))):
            on_reject("unauthenticated")
            return error(401, "a valid API key is required: header 'Authorization: Bearer "
                         "<key>'", kind="invalid_api_key")
        return await call_next(request)

    async def generate(request: Request, parse: Parser) -> Response:
        try:
            req = await parse(await _read_json(request), backend)
        except ValidationError as e:
            on_reject("invalid_argument")
            return _backend_error(e)
        gen = _Generation(backend, req, request)
        try:
            if req.stream:
                chunks = gen.chunks()
                first = await anext(chunks)  # errors before the first token get a status
                return StreamingResponse(_sse(backend, req, gen, first, chunks),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await _collect(backend, req, gen)
        except (ValueError, BackendUnavailable, DeadlineExceeded, Overloaded) as e:
            gen.close()
            return _backend_error(e)
        except BaseException:
            gen.close()
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, oai.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, oai.parse_chat)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        m = backend.model
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0,
                                            "owned_by": "pdserve",
                                            "max_model_len": m.max_model_len}]}

    @app.get("/health")
    @app.get("/health/ready")
    async def health() -> Response:
        """Readiness: gRPC health's status (workers, the canary, shutting down)."""
        if is_serving():
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not_serving"}, status_code=503)

    @app.get("/health/live")
    async def live() -> Response:
        """Liveness: this process answers (the canary's verdict does not restart it)."""
        return JSONResponse({"status": "alive"})

    if registry is not None:
        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/status")
    async def status() -> Response:
        try:
            return JSONResponse({"serving": is_serving(), **await backend.status()})
        except BackendUnavailable as e:
            return error(503, str(e), kind="service_unavailable")

    return app


async def _collect(backend: Backend, req: oai.OpenAIRequest, gen: _Generation) -> Response:
    texts: list[str] = []
    entries: list[dict[int, float]] = []
    last = None
    try:
        async for chunk in gen.chunks():
            texts.append(chunk.text_delta)
            entries += chunk.logprobs or []
            last = chunk
    finally:
        gen.close()
    assert last is not None and last.is_last  # chunks() ends only after the last chunk
    logprobs = oai.logprobs_json(req, backend, entries)
    return JSONResponse(oai.response_object(req, "".join(texts), last, logprobs))


async def _sse(backend: Backend, req: oai.OpenAIRequest, gen: _Generation,
               first: GenerateChunk, chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    created = int(time.time())
    is_first = True
    try:
        chunk: GenerateChunk | None = first
        while chunk is not None:
            if chunk.text_delta or chunk.logprobs or chunk.is_last or is_first:
                obj = oai.chunk_object(req, chunk.text_delta, chunk.finish_reason,
                                       oai.logprobs_json(req, backend, chunk.logprobs), created,
                                       role=is_first)
                if chunk.is_last:
                    obj["timing"] = oai.timing(chunk.timing)
                if req.continuous_usage:
                    obj["usage"] = oai.usage(chunk)
                is_first = False
                yield _event(obj)
                if chunk.is_last and req.include_usage:  # OpenAI: one more, choices empty
                    yield _event({**obj, "choices": [], "usage": oai.usage(chunk), "timing": None})
            chunk = None if chunk.is_last else await anext(chunks, None)
        yield "data: [DONE]\n\n"
    except (ValueError, BackendUnavailable, DeadlineExceeded, Overloaded) as e:
        body = json.loads(_backend_error(e).body)
        yield _event(body)
    finally:
        gen.close()


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
