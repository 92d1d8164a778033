"""OpenAI-compatible HTTP API on FastAPI, over a Backend.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events)
    POST /v1/responses (OpenAI's Responses API over the chat path: gateway/openai/responses_api.py)
    POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's; gateway/openai/tokenize_api.py)
    GET  /v1/models   GET /health (= /health/ready)   GET /health/live   GET /internal/status (counts and free KV blocks)
    GET  /metrics (Prometheus; gateway/metrics.py)

Each generation runs in its own task, watched by a second task that waits for the client's
`http.disconnect`: a client that goes away cancels the generation, which aborts the request in
the backend (service_infra/backend.py), whether it is streamed or not.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.asgi import Authorize, GenerationRoutes, error
from gateway.auth import APIKeys
from gateway.openai import protocol as oai
from gateway.openai import response_objects as responses
from gateway.openai import responses_api, responses_stream, tokenize_api
from gateway.openai.chat_output import ChatStream
from gateway.openai.choices import DEFAULT_MAX_NUM_CHOICES, ChoiceStreams
from gateway.openai.reasoning import resolve_parser
from gateway.openai.sse import (
    PLACEHOLDER,
    ChunkTemplate,
    Disconnect,
    EventStream,
    event_bytes,
    named_event_bytes,
)
from gateway.openai.validation import UnknownModelError, ValidationError
from service_infra.backend import (
    Backend,
    BackendUnavailable,
    DeadlineExceeded,
    GenerateChunk,
    Overloaded,
)

MAX_BODY_BYTES = 4 << 20  # larger request bodies are refused with 400
Parser = Callable[[Any, Backend, int], Awaitable[oai.OpenAIRequest]]


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


class _Generation(ChoiceStreams):
    """The request's choice streams (gateway/openai/choices.py), ended when the HTTP client leaves:
    its task (the handler's, which streams the response too) is cancelled, which closes a
    single choice's stream; the choices' own tasks are cancelled (n > 1)."""

    def __init__(self, backend: Backend, req: oai.OpenAIRequest, request: Request) -> None:
        super().__init__(backend, req.inputs, req.n)
        self.disconnect = Disconnect(request.receive, on_disconnect=super().close)

    def close(self) -> None:
        super().close()
        self.disconnect.close()


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
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ValidationError("body", f"the request body is not valid JSON: {e}") from None


def build_app(backend: Backend, is_serving: Callable[[], bool],
              registry: CollectorRegistry | None = None,
              on_reject: Callable[[str], None] = lambda reason: None,
              api_keys: APIKeys | None = None,
              max_num_choices: int = DEFAULT_MAX_NUM_CHOICES,
              reasoning_parser: str = "auto"):
    """The OpenAI API, an ASGI app; also /health, /internal/status and, given a registry,
    /metrics.
    With API keys, /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>` (401
    otherwise). A request may ask for at most `max_num_choices` choices (n x prompts).
    `reasoning_parser`: auto, think, harmony or none (gateway/openai/reasoning.py), resolved against
    the chat template when a chat request comes."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    keys = api_keys or APIKeys()

    async def generate(request: Request, parse: Parser, collect=None, sse=None) -> Response:
        """parse -> an OpenAIRequest (or, with collect and sse, a request holding one as
        `chat`); its choices run, then collect(request, gen) answers, or sse(request, gen,
        first chunk, chunks) streams."""
        try:
            req = await parse(await _read_json(request), backend, max_num_choices)
        except ValidationError as e:
            on_reject("invalid_argument")
            return _backend_error(e)
        chat = req if collect is None else req.chat
        collect = collect or functools.partial(_collect, backend)
        sse = sse or functools.partial(_sse, backend)
        gen = _Generation(backend, chat, request)
        try:
            if chat.stream:
                chunks = gen.chunks()
                first = await anext(chunks)  # errors before the first token get a status
                return EventStream(sse(req, gen, first, chunks), gen.disconnect)
            return await collect(req, gen)
        except (ValueError, BackendUnavailable, DeadlineExceeded, Overloaded) as e:
            gen.close()
            return _backend_error(e)
        except asyncio.CancelledError:
            gen.close()
            if not gen.disconnect.is_disconnected:
                raise
            return Response(status_code=499)  # the client left: nobody reads this
        except BaseException:
            gen.close()
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, oai.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parser = resolve_parser(reasoning_parser, backend.tokenizer.chat_template)
        return await generate(request, functools.partial(oai.parse_chat,
                                                         reasoning_parser=parser))

    async def tokens(request: Request, handle) -> Response:
        try:
            return JSONResponse(await handle(await _read_json(request), backend))
        except ValidationError as e:
            on_reject("invalid_argument")
            return _backend_error(e)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        parser = resolve_parser(reasoning_parser, backend.tokenizer.chat_template)
        return await generate(request, functools.partial(responses_api.parse,
                                                         reasoning_parser=parser),
                              _collect_response, _response_events)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokens(request, tokenize_api.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokens(request, tokenize_api.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return JSONResponse(tokenize_api.tokenizer_info(backend))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        m = backend.model
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "pdserve",
                                            "max_model_len": m.max_model_len}
                                           for name in m.served_names]}

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

    # the generation endpoints straight on ASGI (GenerationRoutes), the rest through FastAPI
    fast = GenerationRoutes(app, {"/v1/completions": completions,
                                  "/v1/chat/completions": chat_completions,
                                  "/v1/responses": create_response})
    return Authorize(fast, keys, on_reject) if keys.is_enabled else fast


async def _collect(backend: Backend, req: oai.OpenAIRequest, gen: _Generation) -> Response:
    num = len(req.inputs)
    texts: list[list[str]] = [[] for _ in range(num)]
    entries: list[list[dict[int, float]]] = [[] for _ in range(num)]
    lasts: dict[int, GenerateChunk] = {}
    prompt_lps: dict[int, list[dict[int, float] | None]] = {}
    try:
        async for index, chunk in gen.chunks():
            texts[index].append(chunk.text_delta)
            entries[index] += chunk.logprobs or []
            lasts[index] = chunk
            if chunk.prompt_logprobs is not None:  # the first attempt's (a migrated
                prompt_lps.setdefault(index, chunk.prompt_logprobs)  # request's prompt grew)
    finally:
        gen.close()
    assert len(lasts) == num and all(c.is_last for c in lasts.values())
    heads = [_echo(backend, req, i, prompt_lps.get(i)) for i in range(num)]
    obj = responses.response_object(
        req, [head + "".join(t) for (head, _), t in zip(heads, texts, strict=True)],
        [lasts[i] for i in range(num)],
        [responses.join_logprobs(head_lp, responses.logprobs_json(req, backend, e))
         for (_, head_lp), e in zip(heads, entries, strict=True)])
    if req.num_prompt_logprobs is not None:
        for i, choice in enumerate(obj["choices"]):
            choice["prompt_logprobs"] = responses.prompt_logprobs_json(req, backend,
                                                                       prompt_lps.get(i))
    return JSONResponse(obj)


async def _collect_response(rr: responses_api.ResponsesRequest,
                            gen: _Generation) -> Response:
    try:
        return JSONResponse(await responses_api.collect(rr, gen.chunks()))
    finally:
        gen.close()


async def _response_events(rr: responses_api.ResponsesRequest, gen: _Generation,
                           first: tuple[int, GenerateChunk],
                           chunks: AsyncIterator[tuple[int, GenerateChunk]]
                           ) -> AsyncIterator[bytes]:
    """The Responses API's events; an error after the first token is an `error` event."""
    try:
        async for event in responses_stream.events(rr, first, chunks, named_event_bytes):
            yield event
    except (ValueError, BackendUnavailable, DeadlineExceeded, Overloaded) as e:
        body = orjson.loads(_backend_error(e).body)["error"]
        yield named_event_bytes("error", {
            "type": "error", "code": body["code"] or body["type"], "message": body["message"],
            "param": body["param"], "sequence_number": 0})
    finally:
        gen.close()


def _echo(backend: Backend, req: oai.OpenAIRequest, index: int,
          prompt_lps: list[dict[int, float] | None] | None) -> tuple[str, dict[str, Any] | None]:
    """What leads choice `index` when echo is on: the prompt's text and logprobs."""
    if not req.echo:
        return "", None
    inp = req.inputs[index]
    text = inp.prompt_text if inp.prompt_text is not None else backend.tokenizer.decode(
        inp.prompt_token_ids, skip_special_tokens=False)
    return text, responses.echo_logprobs(req, backend, inp.prompt_token_ids, prompt_lps)


async def _sse(backend: Backend, req: oai.OpenAIRequest, gen: _Generation,
               first: tuple[int, GenerateChunk],
               chunks: AsyncIterator[tuple[int, GenerateChunk]]) -> AsyncIterator[bytes]:
    """Chunks of all choices interleaved as they come, each with its choice index. A plain
    text delta (not a choice's first or last chunk, no logprobs, usage or parsing) is the
    choice's template with the text spliced in (sse.ChunkTemplate): the same bytes as the
    whole object would give."""
    created = int(time.time())
    started: set[int] = set()
    latest: dict[int, GenerateChunk] = {}
    streams: dict[int, ChatStream] = {}  # chats: by choice index
    templates: dict[int, ChunkTemplate] = {}
    parses = req.is_chat and (req.reasoning or req.tool_choice is not None)
    is_plain = not (parses or req.continuous_usage or req.num_top_logprobs is not None)
    try:
        item: tuple[int, GenerateChunk] | None = first
        while item is not None:
            index, chunk = item
            latest[index] = chunk
            if (is_plain and chunk.text_delta and not chunk.is_last and index in started
                    and not chunk.logprobs):
                template = templates.get(index)
                if template is None:
                    template = templates[index] = ChunkTemplate(responses.chunk_object(
                        req, index, PLACEHOLDER, None, None, created))
                yield template(chunk.text_delta)
                item = await anext(chunks, None)
                continue
            is_first = index not in started
            text, finish_reason, calls, reasoning = (chunk.text_delta, chunk.finish_reason,
                                                     None, "")
            if parses:
                # reasoning_content first, then the content and calls as they are generated
                stream = streams.setdefault(index, ChatStream(req.reasoning, req.reasoning_open,
                                                              req.tool_choice))
                reasoning, text, calls = stream.feed(text)
                if chunk.is_last:
                    more_reasoning, rest, last_calls = stream.finish()
                    reasoning, text, calls = (reasoning + more_reasoning, text + rest,
                                              calls + last_calls)
                    if stream.has_calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
            if chunk.text_delta or chunk.logprobs or chunk.is_last or is_first:
                head, head_lp = _echo(backend, req, index, chunk.prompt_logprobs) \
                    if is_first else ("", None)
                obj = responses.chunk_object(
                    req, index, head + text if head + text or not (calls or reasoning)
                    else None, finish_reason,
                    responses.join_logprobs(head_lp, responses.logprobs_json(req, backend,
                                                                             chunk.logprobs)),
                    created, role=is_first, tool_calls=calls, reasoning=reasoning)
                if is_first and req.num_prompt_logprobs is not None:
                    obj["choices"][0]["prompt_logprobs"] = responses.prompt_logprobs_json(
                        req, backend, chunk.prompt_logprobs)
                if chunk.is_last:
                    obj["timing"] = responses.timing(chunk.timing)
                if req.continuous_usage:
                    obj["usage"] = responses.usage(req, latest)
                started.add(index)
                yield event_bytes(obj)
            item = await anext(chunks, None)
        if req.include_usage:  # OpenAI: one more, choices empty
            yield event_bytes({"id": req.req_id, "object": "chat.completion.chunk"
                               if req.is_chat else "text_completion", "created": created,
                               "model": req.model, "choices": [],
                               "usage": responses.usage(req, latest), "timing": None})
        yield b"data: [DONE]\n\n"
    except (ValueError, BackendUnavailable, DeadlineExceeded, Overloaded) as e:
        yield event_bytes(orjson.loads(_backend_error(e).body))
    finally:
        gen.close()
