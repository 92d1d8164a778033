"""Turns a public request (gRPC GenerateRequest or OpenAI JSON) into a `GenerateInput`.

Checks what the model decides (context length, vocabulary, served model name, chat template)
and leaves the rest to `SamplingParams`, whose `ValueError` already names the field and its
bound: it is caught and re-raised as `ValidationError(field, message)`. Front ends map a
`ValidationError` to INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import jinja2

from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import StructuredOutput
from engine_core.tokenizer import NoChatTemplateError
from gateway.openai.structured import compile_error
from protos.pdserve.v1 import generate_pb2 as pb
from service_infra.backend import Backend, GenerateInput
from service_infra.proto_convert import sampling_kwargs_from_proto, structured_from_proto

DEFAULT_MAX_TOKENS = 16  # gRPC and /v1/completions when max_tokens is unset (OpenAI's default)
MAX_REQUEST_ID_LEN = 128
CHAT_ROLES = ("system", "user", "assistant", "tool")
# texts longer than this are tokenized in a worker thread, not on the event loop
MAX_INLINE_TOKENIZE_CHARS = 4096
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_LEN}}}")  # printable ASCII, no space


class ValidationError(ValueError):
    """A request the server refuses: `field` is the offending field as the API names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class UnknownModelError(ValidationError):
    """The request names a model this server does not serve (HTTP 404, like OpenAI)."""


# -- pieces shared by both APIs ------------------------------------------------------------
def check_model(model: str | None, backend: Backend) -> None:
    names = backend.model.served_names
    if model and model not in names:
        raise UnknownModelError(
            "model", f"model {model!r} is not served here; the served model is "
            + " or ".join(repr(n) for n in names))


def request_id(client_id: str | None, prefix: str = "req-") -> str:
    """The client's id after checking it, else a fresh one."""
    if not client_id:
        return prefix + uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(client_id):
        raise ValidationError(
            "request_id", f"request_id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII "
            f"characters without spaces, got {client_id[:MAX_REQUEST_ID_LEN + 1]!r}")
    return client_id


def sampling_params(field_prefix: str = "", **kwargs: Any) -> SamplingParams:
    """SamplingParams(**kwargs), its ValueError turned into a ValidationError on the field its
    message starts with ("top_p must be in (0, 1], got 1.5" -> top_p)."""
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        first = str(e).split(" ", 1)[0]
        field = first if first in _SAMPLING_FIELDS else "sampling"
        raise ValidationError(field_prefix + field, str(e)) from None


async def encode_text(backend: Backend, text: str, field: str) -> list[int]:
    if not text:
        raise ValidationError(field, f"{field} must not be empty")
    if len(text) <= MAX_INLINE_TOKENIZE_CHARS:
        ids = backend.tokenizer.encode(text)
    else:
        ids = await asyncio.to_thread(backend.tokenizer.encode, text)
    if not ids:
        raise ValidationError(field, f"{field} must produce at least 1 token, got 0")
    return ids


async def encode_chat(backend: Backend, messages: Sequence[dict[str, Any]],
                      field: str, add_generation_prompt: bool = True,
                      tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """`tools` go to a template with a tool section (gateway/openai/tools.py renders the others);
    `template_kwargs`: the request's chat_template_kwargs (check_template_kwargs)."""
    if not messages:
        raise ValidationError(field, f"{field} must contain at least 1 message, got 0")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise ValidationError(f"{field}[{i}].role",
                                  f"{field}[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                  f"got {m.get('role')!r}")
    tokenizer = backend.tokenizer
    try:
        if not tools and sum(len(m["content"] or "") for m in messages) \
                <= MAX_INLINE_TOKENIZE_CHARS:
            return tokenizer.apply_chat_template(list(messages), add_generation_prompt,
                                                 template_kwargs=template_kwargs)
        return await asyncio.to_thread(tokenizer.apply_chat_template, list(messages),
                                       add_generation_prompt, tools, template_kwargs)
    except NoChatTemplateError as e:
        raise ValidationError(field, f"{field}: {e}") from None
    except (ValueError, TypeError, jinja2.TemplateError) as e:  # the template refuses them
        raise ValidationError(field, f"{field}: the chat template refused them: {e}") from None


# apply_chat_template's own arguments, which chat_template_kwargs may not set
_TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template",
                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs")


def check_template_kwargs(value: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """vLLM's chat_template_kwargs: an object of more variables for the chat template ({}
    for None), none of them apply_chat_template's own arguments."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValidationError(field, f"{field} must be an object, got {value!r:.100}")
    taken = sorted(k for k in value if k in _TEMPLATE_ARGUMENTS)
    if taken:
        raise ValidationError(field, f"{field} may not set {', '.join(taken)} (the request "
                              f"sets them)")
    return value


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def template_kwargs(kwargs: Any, effort: Any, kwargs_field: str = "chat_template_kwargs",
                    effort_field: str = "reasoning_effort") -> dict[str, Any]:
    """chat_template_kwargs, with OpenAI's reasoning_effort (None: unset) passed to the
    template as the variable of that name (GPT-OSS's template sets its reasoning level from
    it) unless the kwargs set it."""
    kwargs = check_template_kwargs(kwargs, kwargs_field)
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise ValidationError(effort_field, f"{effort_field} must be one of "
                              f"{', '.join(REASONING_EFFORTS)}, got {effort!r:.40}")
    return {"reasoning_effort": effort, **kwargs}


async def check_structured(backend: Backend, so: StructuredOutput | None, field: str) -> None:
    """The grammar compiles (off the event loop, cached), else a ValidationError on `field`."""
    if so is not None:
        error = await compile_error(backend, so)
        if error is not None:
            raise ValidationError(field, f"{field} is {error}")


def check_token_ids(ids: Sequence[int], field: str, vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValidationError(f"{field}[{i}]",
                                  f"{field}[{i}] must be in [0, {vocab_size}), got {t}")


def check_lengths(backend: Backend, num_prompt_tokens: int, params: SamplingParams,
                  prompt_field: str, field_prefix: str = "") -> None:
    """The checks SamplingParams cannot make: they need the model."""
    max_len = backend.model.max_model_len
    max_tokens_field = field_prefix + "max_tokens"
    if num_prompt_tokens > max_len - 1:
        raise ValidationError(
            prompt_field, f"{prompt_field} is {num_prompt_tokens} tokens; at most "
            f"max_model_len - 1 = {max_len - 1} (room for 1 generated token)")
    if params.max_tokens > max_len:
        raise ValidationError(max_tokens_field, f"{max_tokens_field} must be <= max_model_len "
                              f"({max_len}), got {params.max_tokens}")
    if num_prompt_tokens + params.max_tokens > max_len:
        raise ValidationError(
            max_tokens_field, f"prompt ({num_prompt_tokens} tokens) + {max_tokens_field} "
            f"({params.max_tokens}) must be <= max_model_len ({max_len}), got "
            f"{num_prompt_tokens + params.max_tokens}")
    check_token_ids(params.stop_token_ids, field_prefix + "stop_token_ids",
                    backend.model.vocab_size)
    vocab_size = backend.model.vocab_size
    if params.structured is not None:
        check_token_ids(params.structured.after_tokens,
                        field_prefix + "structured.after_tokens", vocab_size)
    for token_id, _ in params.logit_bias:
        if token_id >= vocab_size:
            raise ValidationError(field_prefix + "logit_bias",
                                  f"{field_prefix}logit_bias token ids must be in [0, "
                                  f"{vocab_size}), got {token_id}")


# -- gRPC ------------------------------------------------------------------------------------
async def from_proto(req: pb.GenerateRequest, backend: Backend,
                     deadline: float | None = None, field: str | None = None) -> GenerateInput:
    """A gRPC GenerateRequest as a GenerateInput (raises ValidationError). A chat comes
    rendered to token ids (gateway/openai/grpc_chat.py); `field`: the prompt's name in errors, where
    it was not the token ids (a rendered chat)."""
    arrival = time.monotonic()
    check_model(req.model, backend)
    req_id = request_id(req.request_id)
    kind = req.WhichOneof("prompt")
    text = None
    if kind == "text":
        text = req.text
        ids = await encode_text(backend, text, "text")
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise ValidationError("token_ids", "token_ids must contain at least 1 token, got 0")
        check_token_ids(ids, "token_ids.ids", backend.model.vocab_size)
    else:
        raise ValidationError("prompt", "prompt must be set: one of text, token_ids or chat")
    params = sampling_params("sampling.", **proto_sampling_kwargs(req.sampling))
    check_lengths(backend, len(ids), params, field or kind or "prompt", "sampling.")
    await check_structured(backend, params.structured, "sampling.structured")
    return GenerateInput(req_id, ids, params, text, deadline, arrival)


def proto_sampling_kwargs(s: pb.SamplingParameters) -> dict[str, Any]:
    """SamplingParams keyword arguments (service_infra.proto_convert's one conversion); an
    unset max_tokens takes the gateway's default, an unreadable structured constraint is a
    ValidationError naming it."""
    try:
        return sampling_kwargs_from_proto(s, max_tokens_default=DEFAULT_MAX_TOKENS)
    except ValueError as e:
        raise ValidationError("sampling.structured", f"sampling.structured: {e}") from None


def structured_of(s: pb.SamplingParameters) -> StructuredOutput | None:
    """s.structured as a StructuredOutput (None: unset), or a ValidationError naming it."""
    try:
        return structured_from_proto(s.structured)
    except ValueError as e:
        raise ValidationError("sampling.structured", f"sampling.structured: {e}") from None
