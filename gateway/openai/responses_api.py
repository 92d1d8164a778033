"""OpenAI's Responses API (POST /v1/responses) over the chat path: a request becomes the chat
completion it means, validated and run as one (gateway/openai/protocol.py), and its output
becomes the Responses API's output items, whole or as a stream of typed events.

    request                               chat completion
    input (a string, or items)            messages: role messages ("developer" = system),
                                          function_call -> an assistant's tool_calls,
                                          function_call_output -> a tool message
    instructions                          a system message first
    tools [{type: function, name, ...}]   tools [{type: function, function: {name, ...}}]
    tool_choice {type: function, name}    tool_choice {type: function, function: {name}}
    text.format (json_schema, ...)        response_format
    reasoning.effort                      reasoning_effort
    max_output_tokens                     max_completion_tokens

    output items, in the order generated: a reasoning item (the reasoning parser's,
    gateway/openai/reasoning.py), a message with one output_text part (the content), a function_call
    per tool call. Status "incomplete" (incomplete_details.reason "max_output_tokens") for an
    output cut by the length limit; usage's reasoning_tokens, the tokens whose text went to
    the reasoning (ReasoningTokens). Streamed: gateway/openai/responses_stream.py.

Nothing is stored: `store` is accepted and answered false, and previous_response_id,
conversation, background and stored prompts are refused (400 naming the field). Only function
tools run here. Logprobs (include "message.output_text.logprobs", top_logprobs 0..20 for the
alternatives) are those of every output token, reasoning's included as in vLLM's Responses
API, on the message's output_text part (streamed with the output_text deltas; tokens whose
text is held back ride on the next delta); other include values are accepted and have nothing
to add here (no encrypted reasoning, no hosted tools).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway.openai import protocol as oai
from gateway.openai import response_objects as oai_responses
from gateway.openai.chat_output import ChatStream, chat_message
from gateway.openai.validation import ValidationError
from service_infra.backend import Backend, GenerateChunk

# copied as they are into the chat completion (the sampling fields both APIs share, and
# vLLM's extras)
_SHARED = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "seed", "top_k",
           "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
           "logit_bias", "min_tokens", "ignore_eos", "chat_template_kwargs", "structured_outputs",
           "user")
_REFUSED = {
    "previous_response_id": "this server stores no responses: send the whole conversation "
                            "as input",
    "conversation": "this server stores no conversations: send the whole conversation as input",
    "prompt": "this server stores no prompts",
    "background": "background responses are not supported",
}
LOGPROBS = "message.output_text.logprobs"
# what `include` may name (OpenAI's values): only LOGPROBS adds anything here
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url", "file_search_call.results",
              "message.input_image.image_url", "web_search_call.action.sources")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# chat field names in errors -> this API's
_FIELDS = ((re.compile(r"\bmessages\b"), "input"),
           (re.compile(r"\bmax_completion_tokens\b|\bmax_tokens\b"), "max_output_tokens"),
           (re.compile(r"\bresponse_format\b"), "text.format"),
           (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
           (re.compile(r"\b(tools\[\d+\]|tool_choice)\.function\b"), r"\1"))


@dataclass(frozen=True)
class ResponsesRequest:
    chat: oai.OpenAIRequest
    body: dict[str, Any]  # what the response echoes (instructions, tools, metadata, ...)
    id: str
    created_at: int
    # the backend's per-token logprob entries as output_text logprobs; None: not asked for
    logprobs: Callable[[list[dict[int, float]]], list[dict[str, Any]]] | None = None


def _renamed(e: ValidationError) -> ValidationError:
    field, message = e.field, e.message
    for pattern, name in _FIELDS:
        field, message = pattern.sub(name, field), pattern.sub(name, message)
    return type(e)(field, message)  # (UnknownModelError stays a 404)


def _text(content: Any, field: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or parts of the given types joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(field, f"{field} must be a string or a list of parts, got "
                              f"{content!r:.100}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise ValidationError(f"{field}[{j}]", f"{field}[{j}] must be a text part "
                                  f"({', '.join(kinds)}), got {part!r:.100}")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as chat messages (instructions first)."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValidationError("instructions", "instructions must be a string")
    out = [{"role": "system", "content": instructions}] if instructions else []
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValidationError("input", "input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValidationError(field, f"{field} must be an object, got {item!r:.100}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ValidationError(f"{field}.role", f"{field}.role must be one of "
                                      f"{', '.join(_ROLES)}, got {role!r:.40}")
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            out.append({"role": _ROLES[role],
                        "content": _text(item.get("content"), f"{field}.content", parts)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"),
                                                    item.get("arguments"))):
                raise ValidationError(field, f"{field}: a function_call needs call_id, name "
                                      "and arguments, each a string")
            if out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
                out[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"),
                                                                          str):
                raise ValidationError(field, f"{field}: a function_call_output needs call_id "
                                      "and output, each a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
        elif kind != "reasoning":  # earlier reasoning is not sent back to the model
            raise ValidationError(f"{field}.type", f"{field}.type {kind!r:.40} is not "
                                  "supported: message, function_call, function_call_output "
                                  "or reasoning")
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """tools and tool_choice in the chat completion's form."""
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValidationError("tools", "tools must be a list")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise ValidationError(f"tools[{i}].type", f"tools[{i}]: only function tools "
                                      f"run here, got {tool!r:.100}")
            chat["tools"].append({"type": "function", "function": {
                k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _format(body: dict[str, Any]) -> dict[str, Any]:
    """text.format as the chat completion's response_format."""
    text = body.get("text")
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise ValidationError("text.format", "text.format must be an object of type text, "
                              f"json_object or json_schema, got {fmt!r:.100}")
    if fmt["type"] == "text":
        return {}
    if fmt["type"] == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}}


async def parse(body: Any, backend: Backend, max_num_choices: int,
                reasoning_parser: str | None) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ValidationError("body", "the request body must be a JSON object")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False, 0):
            raise ValidationError(name, f"{name}: {why}")
    chat = {k: body[k] for k in _SHARED if k in body}
    chat["messages"] = _messages(body)
    chat.update(_tools(body))
    chat.update(_format(body))
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    chat.update(_logprobs(body))
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise ValidationError("reasoning", "reasoning must be an object")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    try:
        req = await oai.parse_chat(chat, backend, max_num_choices, reasoning_parser)
    except ValidationError as e:
        raise _renamed(e) from None

    def logprobs(entries: list[dict[int, float]]) -> list[dict[str, Any]]:
        return (oai_responses.logprobs_json(req, backend, entries) or {}).get("content", [])

    return ResponsesRequest(req, body, "resp_" + uuid.uuid4().hex, int(time.time()),
                            logprobs if req.num_top_logprobs is not None else None)


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """include and top_logprobs as the chat completion's logprobs and top_logprobs."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list):
        raise ValidationError("include", f"include must be a list, got {include!r:.100}")
    for i, value in enumerate(include):
        if value not in INCLUDABLE:
            raise ValidationError(f"include[{i}]", f"include[{i}] must be one of "
                                  f"{', '.join(INCLUDABLE)}, got {value!r:.100}")
    top = body.get("top_logprobs")
    if LOGPROBS in include or top:  # alternatives asked for: the tokens' own too
        return {"logprobs": True, "top_logprobs": 0 if top is None else top}
    return {}


# -- output ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ReasoningTokens:
    """Output tokens whose text the reasoning parser put in the reasoning: `feed` each chunk
    with what its text gave (reasoning, content, calls). A chunk whose text is all held back
    (a tag, or part of one) counts with the next chunk that gives any."""

    def __init__(self) -> None:
        self.count = 0
        self._held = 0

    def feed(self, chunk: GenerateChunk, reasoning: str, content: str, calls: list) -> None:
        self._held += len(chunk.token_ids)
        if reasoning or content or calls:
            if reasoning and not content and not calls:
                self.count += self._held
            self._held = 0


def _usage(last: GenerateChunk, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": last.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "output_tokens": last.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens}


def response_json(rr: ResponsesRequest, output: list[dict[str, Any]],
                  last: GenerateChunk | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The response object: in progress (no last chunk yet), completed or incomplete."""
    body = rr.body
    status = "in_progress" if last is None else (
        "incomplete" if last.finish_reason == "length" else "completed")
    return {
        "id": rr.id, "object": "response", "created_at": rr.created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"}
        if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens":
        body.get("max_output_tokens"), "model": rr.chat.model, "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "top_logprobs": body.get("top_logprobs"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning"), "metadata": body.get("metadata") or {},
        "store": False, "background": False, "previous_response_id": None,
        "truncation": "disabled", "user": body.get("user"),
        "usage": None if last is None else _usage(last, reasoning_tokens),
    }


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
                 ) -> list[dict[str, Any]]:
    """A finished chat message (chat_output.chat_message) as output items; `logprobs`: the
    message's output_text logprobs."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs_"), message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(message_item(new_id("msg_"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(call_item(new_id("fc_"), call["id"], call["function"]["name"],
                                call["function"]["arguments"], "completed"))
    if not items:  # nothing: an empty answer
        items = [message_item(new_id("msg_"), "", "completed")]
    for item in items:
        if item["type"] == "message" and logprobs:
            item["content"][0]["logprobs"] = logprobs
    return items


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


async def collect(rr: ResponsesRequest, chunks: AsyncIterator[tuple[int, GenerateChunk]]
                  ) -> dict[str, Any]:
    texts, entries, last = [], [], None
    stream, reasoning = ChatStream(rr.chat.reasoning, rr.chat.reasoning_open,
                                   rr.chat.tool_choice), ReasoningTokens()
    async for _, chunk in chunks:
        texts.append(chunk.text_delta)
        entries += chunk.logprobs or []
        parts = stream.feed(chunk.text_delta)
        if chunk.is_last:  # what the stream held back, as what it turned out to be
            parts = tuple(a + b for a, b in zip(parts, stream.finish(), strict=True))
        reasoning.feed(chunk, *parts)
        last = chunk
    message, _ = chat_message("".join(texts), rr.chat.reasoning, rr.chat.reasoning_open,
                              rr.chat.tool_choice)
    logprobs = rr.logprobs(entries) if rr.logprobs is not None else None
    return response_json(rr, output_items(message, logprobs), last, reasoning.count)
