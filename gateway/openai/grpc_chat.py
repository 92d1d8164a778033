"""A gRPC chat (GenerateRequest.chat) as /v1/chat/completions serves one: rendered here with
its tools and template variables, and its output split into reasoning, content and tool calls
as it streams (gateway/openai/chat_output.py).

    render   ChatMessages -> token ids (the chat template, through the tool section or the
             generic tool format; chat_template_kwargs_json and reasoning_effort as template
             variables); tool_choice required / named -> sampling.structured; a thinking
             chat's grammar starts after </think>, a GPT-OSS chat's response format after its
             final channel's header; harmony keeps special tokens
    output   each sample's text -> GenerateResponse.reasoning, .text (the content),
             .tool_call_deltas as generated, .tool_calls whole in its last message
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.openai.chat_output import ChatStream
from gateway.openai.reasoning import chat_prompt
from gateway.openai.structured import compile_error
from gateway.openai.tools import ToolChoice, encode_tool_chat, parse_tools, tool_calls_to_proto
from gateway.openai.validation import ValidationError, structured_of, template_kwargs
from protos.pdserve.v1 import generate_pb2 as pb
from service_infra.backend import Backend
from service_infra.proto_convert import structured_to_proto


@dataclass(frozen=True)
class ChatOutput:
    """How a chat's output is split: the server's reasoning parser ("think", "harmony" or
    None), whether the prompt left the model inside <think>, the tools' choice."""

    parser: str | None
    reasoning_open: bool
    tool_choice: ToolChoice | None

    def stream(self) -> ChatStream:
        return ChatStream(self.parser, self.reasoning_open, self.tool_choice)


def _json_field(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ValidationError(field, f"{field} must be JSON, got {text!r:.100}") from None


async def render(req: pb.GenerateRequest, backend: Backend,
                 parser: str | None) -> tuple[pb.GenerateRequest, ChatOutput | None]:
    """A chat request as the token-id request the rest of the path knows, and how to split
    its output (None: as it is). Other requests come back as they are. `parser`: the
    server's reasoning parser for this model (reasoning.resolve_parser)."""
    if req.WhichOneof("prompt") != "chat":
        return req, None
    chat = req.chat
    body: dict[str, Any] = {}
    for name, text in (("tools", chat.tools_json), ("tool_choice", chat.tool_choice_json)):
        if text:
            body[name] = _json_field(text, f"chat.{name}_json")
    if chat.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = chat.parallel_tool_calls
    try:
        tools, choice, constraint = parse_tools(body)
    except ValidationError as e:
        raise ValidationError(f"chat.{e.field}", e.message) from None
    if constraint is not None:
        if req.sampling.HasField("structured"):
            raise ValidationError("chat.tool_choice_json", "tool_choice required or a named "
                                  "function constrains the output: sampling.structured must "
                                  "be unset")
        error = await compile_error(backend, constraint)
        if error is not None:
            raise ValidationError("chat.tools_json", f"chat.tools_json: the parameters are "
                                  f"{error}")
    variables = template_kwargs(
        _json_field(chat.chat_template_kwargs_json, "chat.chat_template_kwargs_json")
        if chat.chat_template_kwargs_json else None, chat.reasoning_effort or None,
        "chat.chat_template_kwargs_json", "chat.reasoning_effort")
    messages = [{"role": m.role, "content": m.content,
                 **({"tool_calls": [{"id": c.id, "type": "function", "function": {
                     "name": c.name, "arguments": c.arguments}} for c in m.tool_calls]}
                    if m.tool_calls else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})}
                for m in chat.messages]
    ids = await encode_tool_chat(backend, messages, tools, "chat.messages", variables)
    out = pb.GenerateRequest()
    out.CopyFrom(req)
    out.token_ids.ids[:] = ids  # replaces the chat (one of the prompt oneof)
    if constraint is not None:
        out.sampling.structured.CopyFrom(structured_to_proto(constraint))
    if parser == "harmony":  # its channels are special tokens
        out.sampling.skip_special_tokens = False
    # did the generation prompt open <think>? where does the grammar start?
    reasoning_open, so = chat_prompt(backend.tokenizer, parser, ids, structured_of(out.sampling),
                                     constraint is not None)
    if so is not None:
        out.sampling.structured.CopyFrom(structured_to_proto(so))
    if parser is None and choice is None:
        return out, None
    return out, ChatOutput(parser, reasoning_open, choice)


async def split_output(responses: AsyncIterator[pb.GenerateResponse],
                       spec: ChatOutput | None) -> AsyncIterator[pb.GenerateResponse]:
    """Each sample's messages with its text split: reasoning apart, content held back where a
    tool call may start, calls streamed as tool_call_deltas while they are generated and put
    whole into the sample's last message (then finish_reason TOOL_CALLS)."""
    streams: dict[int, ChatStream] = {}
    async for msg in responses:
        if spec is not None:
            stream = streams.get(msg.index)
            if stream is None:
                stream = streams[msg.index] = spec.stream()
            reasoning, msg.text, deltas = stream.feed(msg.text)
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                more, rest, last = stream.finish()
                reasoning, msg.text, deltas = reasoning + more, msg.text + rest, deltas + last
                if stream.has_calls:
                    msg.tool_calls.extend(tool_calls_to_proto(stream.calls()))
                    if msg.finish_reason == pb.FINISH_REASON_STOP:
                        msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS
            msg.reasoning = reasoning
            msg.tool_call_deltas.extend(
                pb.ToolCallDelta(index=d["index"], id=d.get("id", ""),
                                 name=d["function"].get("name", ""),
                                 arguments=d["function"]["arguments"]) for d in deltas)
        yield msg
