"""The two clients of the load generator: gRPC (pdserve.v1.Generation) and OpenAI HTTP with
server-sent events. Each sends one `BenchRequest`, streamed, greedy unless told otherwise, and
returns what it saw as a `RequestResult`; a failure is a result with its error, never an
exception (cancellation aside: the runner cancels requests at its time limit).

By default (`api="chat"`) every prompt goes out as a chat request, the way clients send them:
a plain prompt's text becomes the user message (over HTTP `/v1/chat/completions` with
`max_completion_tokens`); `api="completions"` sends it as a completion (text over HTTP, token
ids over gRPC). Each result keeps the answer's text (multi-turn builds the next turn from it)
and the server's timing breakdown from the last message.

Over gRPC a message carries its tokens (`token_ids`), so a message of k tokens gives k ITL
entries (metrics.spread_itl). An SSE event does not say how many tokens it holds: each event
with text counts as one, as in `vllm bench serve`; the output length is the server's
`usage.completion_tokens` (stream_options.include_usage), else the number of events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import httpx2 as httpx

from pdserve.bench.metrics import RequestResult, spread_itl
from pdserve.bench.workloads import BenchRequest
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Sampling:
    """What every request of a run asks for; None leaves a field out (the server's default:
    temperature 1.0, the others off)."""

    temperature: float | None = 0.0
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    def fields(self) -> dict[str, float | int]:
        """The set fields, by their request (and proto) names."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        """"greedy", "default sampling" (nothing set) or the set fields."""
        if self.is_greedy:
            return "greedy"
        return ", ".join(f"{k} {v:g}" for k, v in self.fields().items()) or "default sampling"


GREEDY = Sampling(0.0)
APIS = ("chat", "completions")


class Client(Protocol):
    protocol: str

    async def model_id(self) -> str: ...

    async def send(self, req: BenchRequest) -> RequestResult: ...

    async def close(self) -> None: ...


class _Timer:
    """Arrival times of the output tokens of one request."""

    def __init__(self, req: BenchRequest) -> None:
        self.result = RequestResult(group=req.group, input_len=req.input_len)
        self.t_sent = time.perf_counter()
        self.t_last: float | None = None
        self.parts: list[str] = []

    def text(self, text: str) -> None:
        self.parts.append(text)

    def tokens(self, num_tokens: int) -> None:
        now = time.perf_counter()
        r = self.result
        if self.t_last is None:
            r.ttft = now - self.t_sent
            r.itl += [0.0] * (num_tokens - 1)  # arrived with the first token
        else:
            r.itl += spread_itl(now - self.t_last, num_tokens)
        r.output_len += num_tokens
        self.t_last = now

    def finish(self, error: str = "") -> RequestResult:
        r = self.result
        r.latency = (self.t_last or time.perf_counter()) - self.t_sent
        if not error and self.t_last is None:
            error = "the stream ended without a token"
        r.error = error[:MAX_ERROR_CHARS]
        r.text = "".join(self.parts)
        r.is_success = not error
        return r


def _check_api(api: str) -> str:
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    return api


def _messages(req: BenchRequest, api: str) -> tuple[tuple[str, str], ...] | None:
    """The chat messages to send, or None for a plain completion (a prompt of token ids only
    has no text to chat with)."""
    if req.messages is not None:
        return req.messages
    if api == "chat" and req.prompt_text is not None:
        return (("user", req.prompt_text),)
    return None


class GrpcClient:
    protocol = "grpc"

    def __init__(self, address: str, sampling: Sampling = Sampling(), api: str = "chat") -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.sampling = sampling
        self.api = _check_api(api)

    async def model_id(self) -> str:
        return (await self.stub.ListModels(pb.ListModelsRequest(), timeout=30)).models[0].id

    def _request(self, req: BenchRequest) -> pb.GenerateRequest:
        sampling = pb.SamplingParameters(max_tokens=req.output_len, ignore_eos=req.ignore_eos,
                                         **self.sampling.fields())
        if req.response_format is not None:  # a json_schema response_format
            schema = json.loads(req.response_format)["json_schema"]["schema"]
            sampling.structured.json_schema = json.dumps(schema)
        msg = pb.GenerateRequest(sampling=sampling)
        messages = _messages(req, self.api)
        if messages is not None:
            for role, content in messages:
                msg.chat.messages.add(role=role, content=content)
        elif req.prompt_ids is not None:
            msg.token_ids.ids.extend(req.prompt_ids)
        else:
            msg.text = req.prompt_text or ""
        return msg

    async def send(self, req: BenchRequest) -> RequestResult:
        timer = _Timer(req)
        call = self.stub.Generate(self._request(req))
        try:
            async for msg in call:
                if msg.token_ids:
                    timer.tokens(len(msg.token_ids))
                timer.text(msg.text)
                if msg.HasField("usage"):
                    timer.result.input_len = msg.usage.prompt_tokens
                if msg.HasField("timing"):
                    timer.result.timing = {f.name: v for f, v in msg.timing.ListFields()}
        except grpc.aio.AioRpcError as e:
            return timer.finish(f"{e.code().name}: {e.details()}")
        except asyncio.CancelledError:
            call.cancel()
            raise
        return timer.finish()

    async def close(self) -> None:
        await self.channel.close()


class HttpClient:
    protocol = "http"

    def __init__(self, base_url: str, sampling: Sampling = Sampling(), api: str = "chat",
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        # no pool limit: the runner's concurrency is the limit; no read timeout: a long
        # prefill queue is measured, not cut
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"),
                                      timeout=httpx.Timeout(None, connect=30.0),
                                      limits=httpx.Limits(max_connections=None),
                                      transport=transport)
        self.sampling = sampling
        self.api = _check_api(api)
        self._model: str | None = None

    async def model_id(self) -> str:
        if self._model is None:
            resp = await self.http.get("/v1/models")
            resp.raise_for_status()
            self._model = resp.json()["data"][0]["id"]
        return self._model

    async def _body(self, req: BenchRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": await self.model_id(), **self.sampling.fields(),
            "ignore_eos": req.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
        if req.response_format is not None:
            body["response_format"] = json.loads(req.response_format)
        messages = _messages(req, self.api)
        if messages is not None:  # as OpenAI's clients send it now
            body["max_completion_tokens"] = req.output_len
            body["messages"] = [{"role": r, "content": c} for r, c in messages]
            return "/v1/chat/completions", body
        body["max_tokens"] = req.output_len
        body["prompt"] = req.prompt_text if req.prompt_text is not None else \
            list(req.prompt_ids or ())
        return "/v1/completions", body

    async def send(self, req: BenchRequest) -> RequestResult:
        path, body = await self._body(req)
        timer = _Timer(req)
        try:
            async with self.http.sse(path, method="POST", json=body) as events:
                if events.response.status_code != 200:
                    text = (await events.response.aread()).decode(errors="replace")
                    return timer.finish(f"HTTP {events.response.status_code}: {text}")
                async for event in events:
                    if event.data == "[DONE]":
                        break
                    error = self._event(timer, json.loads(event.data))
                    if error:
                        return timer.finish(error)
        except httpx.HTTPError as e:
            return timer.finish(f"{type(e).__name__}: {e}")
        return timer.finish()

    @staticmethod
    def _event(timer: _Timer, data: dict[str, Any]) -> str:
        """Takes one SSE event; returns an error message if it is an error."""
        if "error" in data:
            return f"error event: {data['error'].get('message', data['error'])}"
        for choice in data.get("choices") or ():
            text = choice.get("text") if "text" in choice else \
                (choice.get("delta") or {}).get("content")
            if text:
                timer.tokens(1)
                timer.text(text)
        if data.get("timing"):
            timer.result.timing = data["timing"]
        usage = data.get("usage")
        if usage:
            timer.result.input_len = usage["prompt_tokens"]
            timer.result.output_len = usage["completion_tokens"]
        return ""

    async def close(self) -> None:
        await self.http.aclose()
