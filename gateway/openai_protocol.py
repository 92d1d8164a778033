"""OpenAI's JSON shapes: request bodies -> GenerateInput, GenerateChunks -> response objects.

Covers /v1/completions and /v1/chat/completions with one choice (n = 1) and one prompt per
request; logit_bias as OpenAI's ({"token id": bias in [-100, 100]}). Extra sampling fields that vLLM also accepts (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens) are taken from the body, so the
`openai` client passes them with `extra_body`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from gateway.validation import (
    DEFAULT_MAX_TOKENS,
    ValidationError,
    check_lengths,
    check_model,
    check_token_ids,
    encode_chat,
    encode_text,
    request_id,
    sampling_params,
)
from service_infra.backend import Backend, GenerateChunk, GenerateInput, Timing

# body field -> SamplingParams field, copied when present and not null
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "min_tokens", "ignore_eos",
                "stop_token_ids", "skip_special_tokens")
_BOOLS = ("stream", "ignore_eos", "skip_special_tokens", "echo")


@dataclass(frozen=True)
class OpenAIRequest:
    inp: GenerateInput
    model: str
    is_chat: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    num_top_logprobs: int | None  # None: no logprobs in the response
    # stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far
    continuous_usage: bool = False


def _check_type(body: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        raise ValidationError(name, f"{name} must be {what}, got {value!r}")


def _common(body: Any, backend: Backend) -> dict[str, Any]:
    """Checks both endpoints share; returns SamplingParams keyword arguments."""
    if not isinstance(body, dict):
        raise ValidationError("body", f"the request body must be a JSON object, got "
                              f"{type(body).__name__}")
    for name in _BOOLS:
        _check_type(body, name, (bool,), "a boolean")
    _check_type(body, "model", (str,), "a string")
    check_model(body.get("model"), backend)
    if body.get("n") not in (None, 1):
        raise ValidationError("n", f"n must be 1 (one choice per request), got {body['n']!r}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise ValidationError("stop", f"stop must be a string or a list of strings, got {stop!r}")
    _check_type(body, "stop_token_ids", (list,), "a list of token ids")
    options = body.get("stream_options")
    if options is not None and (not body.get("stream") or not isinstance(options, dict)):
        raise ValidationError("stream_options", "stream_options must be an object, and only "
                              "with stream: true")
    for name in ("include_usage", "continuous_usage_stats"):
        value = (options or {}).get(name)
        if value is not None and not isinstance(value, bool):
            raise ValidationError(f"stream_options.{name}",
                                  f"stream_options.{name} must be a boolean, got {value!r}")
    kwargs = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    if stop is not None:
        kwargs["stop"] = stop
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    return kwargs


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's {"token id as a string": bias}; range checks are SamplingParams'."""
    if not isinstance(value, dict):
        raise ValidationError("logit_bias", f"logit_bias must be an object mapping token ids "
                              f"to biases, got {value!r:.100}")
    bias = {}
    for key, b in value.items():
        token_id = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() \
            else None
        if token_id is None:
            raise ValidationError("logit_bias", f"logit_bias keys must be token ids, got "
                                  f"{key!r:.40}")
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValidationError("logit_bias", f"logit_bias values must be numbers, got "
                                  f"{b!r:.40} for token {key}")
        bias[token_id] = float(b)
    return bias


def _finish(body: dict[str, Any], backend: Backend, ids: list[int], text: str | None,
            kwargs: dict[str, Any], is_chat: bool, num_top: int | None,
            prompt_field: str) -> OpenAIRequest:
    params = sampling_params(**kwargs)
    check_lengths(backend, len(ids), params, prompt_field)
    options = body.get("stream_options") or {}
    prefix = "chatcmpl-" if is_chat else "cmpl-"
    inp = GenerateInput(request_id(None, prefix), ids, params, text)
    return OpenAIRequest(inp, backend.model.name, is_chat, bool(body.get("stream")),
                         bool(options.get("include_usage")), num_top,
                         bool(options.get("continuous_usage_stats")))


async def parse_completion(body: Any, backend: Backend) -> OpenAIRequest:
    kwargs = _common(body, backend)
    for name in ("suffix", "echo"):
        if body.get(name):
            raise ValidationError(name, f"{name} is not supported")
    if body.get("best_of") not in (None, 1):
        raise ValidationError("best_of", f"best_of must be 1, got {body['best_of']!r}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text = None
    if isinstance(prompt, str):
        text = prompt
        ids = await encode_text(backend, prompt, "prompt")
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if not prompt:
            raise ValidationError("prompt", "prompt must not be empty")
        ids = list(prompt)
        check_token_ids(ids, "prompt", backend.model.vocab_size)
    elif isinstance(prompt, list) and prompt:
        raise ValidationError("prompt", f"prompt must be one string or one list of token ids; "
                              f"batches of {len(prompt)} prompts are not supported")
    else:
        raise ValidationError("prompt", f"prompt must be a string or a list of token ids, "
                              f"got {prompt!r:.100}")
    kwargs["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if kwargs["max_tokens"] is None:
        kwargs["max_tokens"] = DEFAULT_MAX_TOKENS
    logprobs = body.get("logprobs")
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    return _finish(body, backend, ids, text, kwargs, False, logprobs, "prompt")


async def parse_chat(body: Any, backend: Backend) -> OpenAIRequest:
    kwargs = _common(body, backend)
    for name in ("tools", "functions"):
        if body.get(name):
            raise ValidationError(name, f"{name} is not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ValidationError("response_format", "response_format must be {'type': 'text'}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValidationError("messages", f"messages must be a list, got {messages!r:.100}")
    ids = await encode_chat(backend, [_message(m, i) for i, m in enumerate(messages)],
                            "messages")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    # OpenAI's chat default: whatever room the context leaves
    kwargs["max_tokens"] = max(1, backend.model.max_model_len - len(ids)) if max_tokens is None \
        else max_tokens
    _check_type(body, "logprobs", (bool,), "a boolean")
    _check_type(body, "top_logprobs", (int,), "an integer")
    num_top = None
    if body.get("logprobs"):
        num_top = body.get("top_logprobs") or 0
        kwargs["logprobs"] = num_top
    elif body.get("top_logprobs") is not None:
        raise ValidationError("top_logprobs", "top_logprobs needs logprobs: true")
    try:
        return _finish(body, backend, ids, None, kwargs, True, num_top, "messages")
    except ValidationError as e:
        if e.field == "logprobs":  # the chat API calls the count top_logprobs
            raise ValidationError("top_logprobs", e.message.replace("logprobs", "top_logprobs",
                                                                    1)) from None
        raise


def _message(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise ValidationError(f"messages[{i}]", f"messages[{i}] must be an object, got {m!r:.80}")
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ValidationError(f"messages[{i}].content[{j}]",
                                      f"messages[{i}].content[{j}] must be a text part "
                                      "({'type': 'text', 'text': ...})")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValidationError(f"messages[{i}].content",
                              f"messages[{i}].content must be a string, got {content!r:.80}")
    return {"role": m.get("role"), "content": content}


# -- responses ---------------------------------------------------------------------------------
def usage(chunk: GenerateChunk) -> dict[str, Any]:
    return {"prompt_tokens": chunk.num_prompt_tokens,
            "completion_tokens": chunk.num_output_tokens,
            "total_tokens": chunk.num_prompt_tokens + chunk.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": chunk.num_cached_tokens}}


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


def response_object(req: OpenAIRequest, text: str, last: GenerateChunk,
                    logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """The non-streamed response."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason,
                              "logprobs": logprobs}
    if req.is_chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": req.inp.req_id, "object": "chat.completion" if req.is_chat else
            "text_completion", "created": int(time.time()), "model": req.model,
            "choices": [choice], "usage": usage(last), "timing": timing(last.timing)}


def chunk_object(req: OpenAIRequest, delta: str | None, finish_reason: str | None,
                 logprobs: dict[str, Any] | None, created: int,
                 role: bool = False) -> dict[str, Any]:
    """One streamed chunk; `delta` None means an empty delta (the final chunk of a chat)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if req.is_chat:
        d: dict[str, Any] = {"role": "assistant"} if role else {}
        if delta is not None:
            d["content"] = delta
        choice["delta"] = d
    else:
        choice["text"] = delta or ""
    return {"id": req.inp.req_id, "object": "chat.completion.chunk" if req.is_chat else
            "text_completion", "created": created, "model": req.model, "choices": [choice],
            "usage": None}
