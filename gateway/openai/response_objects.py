"""OpenAI's response objects, from the backend's GenerateChunks for an OpenAIRequest (parsed
by gateway/openai/protocol.py; gateway/http_api.py collects or streams the chunks).

    response_object      the non-streamed response, every choice with its text and logprobs
    chunk_object         one server-sent chunk of one choice
    usage, timing        the token totals over the choices; pdserve's timing breakdown
    logprobs_json        a choice's logprobs in its endpoint's shape (chat: a content list;
                         completions: token lists), led by an echoed prompt's
                         (echo_logprobs, join_logprobs); vLLM's prompt_logprobs
                         (prompt_logprobs_json)

Choice index = prompt index * n + sample index, as the request fanned out; a prompt's tokens
and prefix-cache hits count once in the usage, from its first sample.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gateway.openai.chat_output import chat_message
from gateway.openai.protocol import OpenAIRequest
from service_infra.backend import Backend, GenerateChunk, Timing


def usage(req: OpenAIRequest, latest: dict[int, GenerateChunk]) -> dict[str, Any]:
    """Totals over the choices' latest chunks (by choice index): each prompt's tokens and
    its prefix-cache hits once (from its first sample, so cached <= prompt tokens, as OpenAI
    reports them; the other samples' shared KV shows in the workers' engine_forks), and
    every choice's output."""
    firsts = [c for i, c in latest.items() if i % req.n == 0]
    num_prompt = sum(c.num_prompt_tokens for c in firsts)
    num_output = sum(c.num_output_tokens for c in latest.values())
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}


def timing(t: Timing | None) -> dict[str, float] | None:
    return None if t is None else dataclasses.asdict(t)


def logprobs_json(req: OpenAIRequest, backend: Backend,
                  entries: list[dict[int, float]] | None) -> dict[str, Any] | None:
    if req.num_top_logprobs is None or entries is None:
        return None

    def token(t: int) -> str:
        return backend.tokenizer.decode([t], skip_special_tokens=False)

    n = req.num_top_logprobs
    if req.is_chat:
        content = []
        for entry in entries:
            (sampled, lp), *_ = entry.items()
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
            content.append({"token": token(sampled), "logprob": lp,
                            "bytes": list(token(sampled).encode()),
                            "top_logprobs": [{"token": token(t), "logprob": v,
                                              "bytes": list(token(t).encode())} for t, v in top]})
        return {"content": content}
    tokens, lps, tops = [], [], []
    for entry in entries:
        (sampled, lp), *_ = entry.items()
        tokens.append(token(sampled))
        lps.append(lp)
        tops.append({token(t): v for t, v in sorted(entry.items(), key=lambda kv: -kv[1])[:n]})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if n else None,
            "text_offset": None}


def echo_logprobs(req: OpenAIRequest, backend: Backend, prompt_ids: list[int],
                  entries: list[dict[int, float] | None] | None) -> dict[str, Any] | None:
    """The prompt's part of an echoed completion's logprobs (the first token's is None), to
    lead the generated tokens' (`logprobs_json`); None when no logprobs were asked for."""
    if req.num_top_logprobs is None or entries is None:
        return None
    tokens = [_token(backend, t) for t in prompt_ids]
    lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for entry in entries[1:]:
        assert entry is not None
        (_, lp), *_ = entry.items()
        lps.append(lp)
        tops.append({_token(backend, t): v for t, v in
                     sorted(entry.items(), key=lambda kv: -kv[1])[:req.num_top_logprobs]})
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": tops if req.num_top_logprobs else None, "text_offset": None}


def join_logprobs(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> Any:
    if head is None or tail is None:
        return tail if head is None else head
    top = None if head["top_logprobs"] is None else \
        head["top_logprobs"] + (tail["top_logprobs"] or [])
    return {"tokens": head["tokens"] + tail["tokens"],
            "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": top, "text_offset": None}


def prompt_logprobs_json(req: OpenAIRequest, backend: Backend,
                         entries: list[dict[int, float] | None] | None) -> Any:
    """vLLM's choice["prompt_logprobs"]: None first, then {token id: {logprob,
    decoded_token}} with the prompt token and the top-n (no rank)."""
    if req.num_prompt_logprobs is None or entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries[1:]:
        assert entry is not None
        (first, _), *_ = entry.items()
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:req.num_prompt_logprobs]
        out.append({str(t): {"logprob": v, "decoded_token": _token(backend, t)}
                    for t, v in [(first, entry[first]), *top]})
    return out


def _token(backend: Backend, t: int) -> str:
    return backend.tokenizer.decode([t], skip_special_tokens=False)


def response_object(req: OpenAIRequest, texts: list[str], lasts: list[GenerateChunk],
                    logprobs: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The non-streamed response: choice i from texts[i], lasts[i] (its last chunk) and
    logprobs[i]; the timing is choice 0's."""
    choices = []
    for index, (text, last, lp) in enumerate(zip(texts, lasts, logprobs, strict=True)):
        choice: dict[str, Any] = {"index": index, "finish_reason": last.finish_reason,
                                  "logprobs": lp}
        if req.is_chat:
            choice["message"], has_calls = chat_message(text, req.reasoning, req.reasoning_open,
                                                        req.tool_choice)
            if has_calls and last.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        choices.append(choice)
    return {"id": req.req_id, "object": "chat.completion" if req.is_chat else
            "text_completion", "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": usage(req, dict(enumerate(lasts))),
            "timing": timing(lasts[0].timing)}


def chunk_object(req: OpenAIRequest, index: int, delta: str | None, finish_reason: str | None,
                 logprobs: dict[str, Any] | None, created: int,
                 role: bool = False,
                 tool_calls: list[dict[str, Any]] | None = None,
                 reasoning: str | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index`; `delta` None means an empty delta (the final
    chunk of a chat). `tool_calls`: OpenAI's tool_calls deltas, each with its call's index
    (chat only; gateway/openai/tool_stream.py). `reasoning`: a reasoning_content delta (chat with a
    reasoning parser; gateway/openai/reasoning.py)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                              "logprobs": logprobs}
    if req.is_chat:
        d: dict[str, Any] = {"role": "assistant"} if role else {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if delta is not None:
            d["content"] = delta
        if tool_calls:
            d["tool_calls"] = tool_calls
        choice["delta"] = d
    else:
        choice["text"] = delta or ""
    return {"id": req.req_id, "object": "chat.completion.chunk" if req.is_chat else
            "text_completion", "created": created, "model": req.model, "choices": [choice],
            "usage": None}
