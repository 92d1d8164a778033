"""The naive baseline: transformers `generate` behind a web server, one request at a time.

    python -m pdserve.bench.naive_server [--model PATH] [--host 127.0.0.1] [--port 8100]

This is the server teams start from before they have an engine: the model loaded with
transformers (from the same GGUF, float32), a lock so that one request generates at a time,
and a generate thread that streams through a TextIteratorStreamer. It speaks the same OpenAI
API as the gateway (POST /v1/completions and /v1/chat/completions, streamed as server-sent
events or not; GET /v1/models, /health), with the fields the benchmark sends: max_tokens,
temperature, top_p, seed, ignore_eos, min_tokens, stream_options.include_usage.

The stock streamer flushes whole words; `TokenStreamer` flushes every token, so that the
client sees one event per token from this server as from the gateway. A client that goes away
stops its generation at the next token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AsyncTextIteratorStreamer, StoppingCriteria, StoppingCriteriaList

from engine_core.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI


class TokenStreamer(AsyncTextIteratorStreamer):
    """Puts the text of every generated token on the queue as soon as it is generated
    (holding back only an incomplete UTF-8 character) and counts the tokens."""

    num_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        ids = value.reshape(-1).tolist()  # batch size 1
        self.num_tokens += len(ids)
        self.token_cache.extend(ids)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        if text.endswith("\ufffd"):
            return
        self.on_finalized_text(text[self.print_len:])
        self.print_len = len(text)


class _StopWhenSet(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


@dataclass(frozen=True)
class Job:
    ids: list[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    seed: int | None


class NaiveServer:
    """One model, one lock: requests wait for the one before them to finish."""

    def __init__(self, model: Any, tokenizer: Tokenizer, name: str, max_model_len: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_model_len = max_model_len
        self.pad_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        self.lock = asyncio.Lock()

    def _generate(self, job: Job, streamer: TokenStreamer, stop: threading.Event,
                  errors: list[BaseException]) -> None:
        x = torch.tensor([job.ids])
        sampling: dict[str, Any] = {"do_sample": False}
        if job.temperature > 0:
            sampling = {"do_sample": True, "temperature": job.temperature, "top_p": job.top_p}
            if job.seed is not None:
                torch.manual_seed(job.seed)
        try:
            with torch.inference_mode():
                self.model.generate(
                    x, attention_mask=torch.ones_like(x), streamer=streamer,
                    max_new_tokens=job.max_tokens, min_new_tokens=job.min_tokens,
                    pad_token_id=self.pad_token_id,
                    stopping_criteria=StoppingCriteriaList([_StopWhenSet(stop)]), **sampling)
        except BaseException as e:  # handed to the event loop; end() unblocks the stream
            errors.append(e)
            streamer.end()

    async def stream(self, job: Job) -> AsyncIterator[tuple[str, int]]:
        """(text delta, tokens so far) per token; the lock is held until the stream ends."""
        async with self.lock:
            streamer = TokenStreamer(self.tokenizer.hf, skip_prompt=True,
                                     skip_special_tokens=True)
            stop = threading.Event()
            errors: list[BaseException] = []
            thread = threading.Thread(target=self._generate,
                                      args=(job, streamer, stop, errors), daemon=True)
            thread.start()
            try:
                async for text in streamer:
                    yield text, streamer.num_tokens
            finally:
                stop.set()
                await asyncio.to_thread(thread.join)
            if errors:
                raise RuntimeError(f"generate failed: {errors[0]!r}") from errors[0]

    def job(self, body: dict[str, Any], ids: list[int], default_max: int) -> Job:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the context length {self.max_model_len}")
        min_tokens = max_tokens if body.get("ignore_eos") else int(body.get("min_tokens") or 0)
        temperature = body.get("temperature")
        return Job(ids, int(max_tokens), min_tokens, 1.0 if temperature is None else
                   float(temperature), float(body.get("top_p") or 1.0), body.get("seed"))


def _chunk(req_id: str, model: str, is_chat: bool, text: str | None,
           finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if is_chat:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["text"] = text or ""
    return {"id": req_id, "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def build_app(server: NaiveServer) -> FastAPI:
    app = FastAPI(title="naive transformers server", docs_url=None, redoc_url=None,
                  openapi_url=None)

    async def generate(body: dict[str, Any], is_chat: bool) -> Response:
        tok = server.tokenizer
        try:
            if is_chat:
                ids = tok.apply_chat_template([{"role": m["role"], "content": m["content"]}
                                               for m in body["messages"]])
                default_max = server.max_model_len - len(ids)
            else:
                prompt = body["prompt"]
                ids = list(prompt) if isinstance(prompt, list) else tok.encode(prompt)
                default_max = DEFAULT_MAX_TOKENS
            job = server.job(body, ids, default_max)
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"error": {"message": f"bad request: {e}",
                                           "type": "invalid_request_error"}}, status_code=400)
        req_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def finish_reason() -> str:
            return "length" if usage["completion_tokens"] >= job.max_tokens else "stop"

        if body.get("stream"):
            async def events() -> AsyncIterator[str]:
                async for text, num_tokens in server.stream(job):
                    usage["completion_tokens"] = num_tokens
                    if text:
                        yield _sse(_chunk(req_id, server.name, is_chat, text, None))
                yield _sse(_chunk(req_id, server.name, is_chat, None, finish_reason()))
                if include_usage:
                    yield _sse({**_chunk(req_id, server.name, is_chat, None, None),
                                "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        texts = []
        async for text, num_tokens in server.stream(job):
            texts.append(text)
            usage["completion_tokens"] = num_tokens
        text = "".join(texts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(), "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if is_chat
                      else {"text": text})
        return JSONResponse({"id": req_id, "object": "chat.completion" if is_chat else
                             "text_completion", "created": int(time.time()),
                             "model": server.name, "choices": [choice], "usage": usage})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(await request.json(), is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(await request.json(), is_chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                            "owned_by": "transformers",
                                            "max_model_len": server.max_model_len}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "serving"}

    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def load(model: str | None, dtype: str) -> NaiveServer:
    """transformers' own loading of the model file (a GGUF is dequantized), and the
    gateway's tokenizer, so that both servers see the same prompt tokens."""
    from transformers import AutoModelForCausalLM

    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer
    from engine_core.weights.gguf_file import transformers_parses_plainly

    source = resolve_model(model)
    if source.kind == "gguf":
        with transformers_parses_plainly():
            hf = AutoModelForCausalLM.from_pretrained(str(source.path.parent),
                                                      gguf_file=source.path.name,
                                                      dtype=getattr(torch, dtype))
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=getattr(torch, dtype))
    tokenizer = load_tokenizer(source)
    return NaiveServer(hf.eval(), tokenizer, source.name, hf.config.max_position_embeddings)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.naive_server",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one per core)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    server = load(args.model, args.dtype)
    print(f"pdserve naive server: HTTP http://{args.host}:{args.port} ({server.name}, "
          f"{args.dtype}, {torch.get_num_threads()} threads, transformers generate, one "
          f"request at a time)", flush=True)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
