"""OpenAI's request bodies -> OpenAIRequest, one GenerateInput per choice (the response
objects: gateway/openai/response_objects.py).

Covers /v1/completions (one prompt, or a batch: a list of strings or of token-id lists) and
/v1/chat/completions, with `n` samples per prompt: one backend request per choice, choice
index = prompt index * n + sample index, sample i of a seeded request seeded seed + i;
n x prompts is bounded by `max_num_choices`. logit_bias as OpenAI's ({"token id": bias in
[-100, 100]}). Extra sampling fields that vLLM also accepts (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens) are taken from the body, so the
`openai` client passes them with `extra_body`. Structured outputs: OpenAI's response_format
(json_object, json_schema) or vLLM's structured_outputs (json, regex, choice, grammar), one
per request, compiled (off the event loop, cached) before anything runs. Chat requests take
vLLM's chat_template_kwargs (more variables for the template, e.g. Qwen3's enable_thinking)
and, with the server's reasoning parser, get their reasoning apart (gateway/openai/reasoning.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gateway.openai.choices import DEFAULT_MAX_NUM_CHOICES, check_num_choices, fan_out
from gateway.openai.reasoning import chat_prompt
from gateway.openai.structured_fields import parse_structured
from gateway.openai.tools import ToolChoice, encode_tool_chat, parse_tools
from gateway.openai.validation import (
    DEFAULT_MAX_TOKENS,
    ValidationError,
    check_lengths,
    check_model,
    check_structured,
    check_token_ids,
    encode_text,
    request_id,
    sampling_params,
    template_kwargs,
)
from service_infra.backend import Backend, GenerateInput

# body field -> SamplingParams field, copied when present and not null
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "min_tokens", "ignore_eos",
                "stop_token_ids", "skip_special_tokens")
_BOOLS = ("stream", "ignore_eos", "skip_special_tokens", "echo")


@dataclass(frozen=True)
class OpenAIRequest:
    # One per choice, by choice index (prompt index * n + sample index).
    inputs: tuple[GenerateInput, ...]
    req_id: str  # the response's id; choice i runs as backend request f"{req_id}-{i}" if n > 1
    n: int  # samples per prompt
    model: str
    is_chat: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    num_top_logprobs: int | None  # None: no logprobs in the response
    # stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far
    continuous_usage: bool = False
    echo: bool = False  # /v1/completions: the prompt (and its logprobs) leads each choice
    # vLLM's prompt_logprobs: each choice gets "prompt_logprobs" (None: not asked for)
    num_prompt_logprobs: int | None = None
    # chat with tools (not tool_choice none): how the output becomes tool_calls
    tool_choice: ToolChoice | None = None
    # chat with a reasoning parser ("think" or "harmony"; gateway/openai/chat_output.py): the
    # output's reasoning apart from its content; reasoning_open: the prompt already opened it
    # (ends with <think>)
    reasoning: str | None = None
    reasoning_open: bool = False


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
    n = body.get("n")
    if n is not None and (type(n) is not int or n < 1):
        raise ValidationError("n", f"n must be an integer >= 1, got {n!r}")
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


async def _structured(body: dict[str, Any], backend: Backend, kwargs: dict[str, Any]) -> None:
    """The body's constraint into kwargs, once it compiles (a 400 naming its field if not)."""
    found = parse_structured(body)
    if found is not None:
        kwargs["structured"], field = found
        await check_structured(backend, kwargs["structured"], field)


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


def _finish(body: dict[str, Any], backend: Backend, prompts: list[tuple[list[int], str | None]],
            kwargs: dict[str, Any], is_chat: bool, num_top: int | None, prompt_field: str,
            max_num_choices: int) -> OpenAIRequest:
    """prompts: (token ids, text or None) each."""
    n = body.get("n") or 1
    check_num_choices(n, len(prompts), max_num_choices)
    params = sampling_params(**kwargs)
    for i, (ids, _) in enumerate(prompts):
        check_lengths(backend, len(ids), params,
                      prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]")
    options = body.get("stream_options") or {}
    req_id = request_id(None, "chatcmpl-" if is_chat else "cmpl-")
    inputs = fan_out([GenerateInput(req_id, ids, params, text) for ids, text in prompts], n,
                     req_id)
    return OpenAIRequest(tuple(inputs), req_id, n, backend.model.name, is_chat,
                         bool(body.get("stream")), bool(options.get("include_usage")), num_top,
                         bool(options.get("continuous_usage_stats")))


async def parse_completion(body: Any, backend: Backend,
                           max_num_choices: int = DEFAULT_MAX_NUM_CHOICES) -> OpenAIRequest:
    kwargs = _common(body, backend)
    await _structured(body, backend, kwargs)
    if body.get("suffix"):
        raise ValidationError("suffix", "suffix is not supported")
    _check_type(body, "prompt_logprobs", (int,), "an integer")
    if body.get("best_of") not in (None, 1):
        raise ValidationError("best_of", f"best_of must be 1, got {body['best_of']!r}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt  # a batch: strings or token-id lists
        fields = [f"prompt[{i}]" for i in range(len(batch))]
    else:
        batch, fields = [prompt], ["prompt"]
    check_num_choices(body.get("n") or 1, len(batch), max_num_choices)  # before tokenizing
    prompts = [await _one_prompt(p, field, backend) for p, field in zip(batch, fields, strict=True)]
    kwargs["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if kwargs["max_tokens"] is None:
        kwargs["max_tokens"] = DEFAULT_MAX_TOKENS
    logprobs = body.get("logprobs")
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    # echo with logprobs returns the prompt tokens' logprobs too (computed by the prefill)
    wanted = [v for v in (body.get("prompt_logprobs"),
                          logprobs if body.get("echo") else None) if v is not None]
    if wanted:
        kwargs["prompt_logprobs"] = max(wanted)
    req = _finish(body, backend, prompts, kwargs, False, logprobs, "prompt", max_num_choices)
    return replace(req, echo=bool(body.get("echo")),
                   num_prompt_logprobs=body.get("prompt_logprobs"))


async def _one_prompt(prompt: Any, field: str, backend: Backend) -> tuple[list[int], str | None]:
    """(token ids, text or None) of one prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return await encode_text(backend, prompt, field), prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        check_token_ids(prompt, field, backend.model.vocab_size)
        return list(prompt), None
    if isinstance(prompt, list) and not prompt:
        raise ValidationError(field, f"{field} must not be empty")
    raise ValidationError(field, f"{field} must be a string or a list of token ids, "
                          f"got {prompt!r:.100}")


async def parse_chat(body: Any, backend: Backend,
                     max_num_choices: int = DEFAULT_MAX_NUM_CHOICES,
                     reasoning_parser: str | None = None) -> OpenAIRequest:
    """reasoning_parser: the server's (reasoning.resolve_parser), "think", "harmony" or None.
    Harmony's structure is special tokens, which its requests' text keeps."""
    kwargs = _common(body, backend)
    if reasoning_parser == "harmony":
        kwargs["skip_special_tokens"] = False
    await _structured(body, backend, kwargs)
    for name in ("functions", "prompt_logprobs"):
        if body.get(name) is not None and body.get(name) is not False:
            raise ValidationError(name, f"{name} is not supported in chat completions")
    tools, tool_choice, tool_constraint = parse_tools(body)
    if tool_constraint is not None:
        if "structured" in kwargs:
            raise ValidationError("tool_choice", "tool_choice required or a named function "
                                  "constrains the output: it cannot be combined with "
                                  "response_format or structured_outputs")
        kwargs["structured"] = tool_constraint
        await check_structured(backend, tool_constraint, "tools")
    ids = await encode_tool_chat(backend, chat_messages(body.get("messages")), tools,
                                 "messages", template_kwargs(body.get("chat_template_kwargs"),
                                                             body.get("reasoning_effort")))
    # did the generation prompt open <think>? where does the grammar start?
    reasoning_open, structured = chat_prompt(backend.tokenizer, reasoning_parser, ids,
                                             kwargs.get("structured"),
                                             tool_constraint is not None)
    if structured is not None:
        kwargs["structured"] = structured
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
        req = _finish(body, backend, [(ids, None)], kwargs, True, num_top, "messages",
                      max_num_choices)
    except ValidationError as e:
        if e.field == "logprobs":  # the chat API calls the count top_logprobs
            raise ValidationError("top_logprobs", e.message.replace("logprobs", "top_logprobs",
                                                                    1)) from None
        raise
    return replace(req, tool_choice=tool_choice, reasoning=reasoning_parser,
                   reasoning_open=reasoning_open)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as {"role", "content"} dicts (text content parts joined), with an
    assistant's `tool_calls` and a tool result's `tool_call_id` kept."""
    if not isinstance(messages, list):
        raise ValidationError("messages", f"messages must be a list, got {messages!r:.100}")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict[str, Any]:
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
    out: dict[str, Any] = {"role": m.get("role"), "content": content}
    calls = m.get("tool_calls")
    if calls is not None and m.get("role") == "assistant":
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise ValidationError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must "
                                  "be a list of {'function': {'name', 'arguments'}} objects")
        out["tool_calls"] = calls
    if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out
