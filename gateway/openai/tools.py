"""Tool calling for /v1/chat/completions: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls` in, `tool_calls` out.

Rendering. When the model's chat template has a tool section (it renders `tools`), the tools
and the conversation's tool calls and results go through it as they are. Otherwise the
generic format below is used: a system message lists the tools and asks for calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes convention that
many templates share); an assistant message's earlier calls are written back as such blocks
and a `tool` message becomes a user turn holding `<tool_response>...</tool_response>`.

tool_choice:
    none       the tools are left out of the prompt; the output is plain content
    auto       the model decides; `<tool_call>` blocks in its output become tool_calls, the
               text before the first block is the content
    required   the output is constrained (structured outputs) to a JSON array of one or more
               calls, {"name", "arguments"} each, arguments valid against that tool's schema
               (exactly one call when parallel_tool_calls is false)
    named      the output is constrained to the named tool's arguments schema

A request with tool calls finishes with finish_reason "tool_calls". Streamed, content is sent
as it comes (holding back what may start a `<tool_call>` tag) and each call as OpenAI
`tool_calls` deltas while it is generated: its id, type and name first, then fragments of its
arguments (gateway/openai/tool_stream.py). A call's `arguments` is the model's own text of the
arguments value, streamed or not.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from engine_core.structured_output import StructuredOutput
from gateway.openai.tool_stream import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    new_call_id,
    raw_arguments,
    scan_calls,
)
from gateway.openai.validation import ValidationError, encode_chat
from protos.pdserve.v1 import generate_pb2 as pb
from service_infra.backend import Backend

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE),
                    re.DOTALL)
MAX_NUM_TOOLS = 128
GENERIC_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are "
    "listed, one JSON object each, between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments between "
    "<tool_call> and </tool_call> tags, one block per call:\n"
    '<tool_call>{{"name": <function name>, "arguments": <arguments object>}}</tool_call>')


@dataclass(frozen=True)
class ToolChoice:
    """What the client asked for; `mode` is "auto", "required" or "named" (none: no
    ToolChoice at all)."""

    mode: str
    names: tuple[str, ...]  # every tool's function name, in order
    name: str | None = None  # the named function
    parallel: bool = True


def parse_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], ToolChoice | None,
                                               StructuredOutput | None]:
    """(the tools as the template takes them, the choice or None, the constraint that enforces
    required/named or None), or a ValidationError naming the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ValidationError("parallel_tool_calls", "parallel_tool_calls must be a boolean, "
                              f"got {parallel!r:.40}")
    if tools is None:
        if choice not in (None, "none"):
            raise ValidationError("tool_choice", "tool_choice needs tools")
        return [], None, None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_NUM_TOOLS:
        raise ValidationError("tools", f"tools must be a list of 1 to {MAX_NUM_TOOLS} tools, "
                              f"got {tools!r:.100}")
    funcs = [_function(t, i) for i, t in enumerate(tools)]
    names = tuple(f["name"] for f in funcs)
    if len(set(names)) != len(names):
        raise ValidationError("tools", "tools must have distinct function names")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return [], None, None
    if choice in ("auto", "required"):
        tc = ToolChoice(choice, names, parallel=parallel is not False)
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in names:
            raise ValidationError("tool_choice", f"tool_choice names {name!r}, which is not "
                                  f"one of the tools ({', '.join(names)})")
        tc = ToolChoice("named", names, name, parallel is not False)
    else:
        raise ValidationError("tool_choice", "tool_choice must be none, auto, required or "
                              "{'type': 'function', 'function': {'name': ...}}, got "
                              f"{choice!r:.100}")
    return [{"type": "function", "function": f} for f in funcs], tc, _constraint(tc, funcs)


def _function(tool: Any, i: int) -> dict[str, Any]:
    field = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise ValidationError(field, f"{field} must be {{'type': 'function', 'function': "
                              f"{{...}}}}, got {tool!r:.100}")
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ValidationError(f"{field}.function.name", f"{field}.function.name must be 1 to "
                              f"64 letters, digits, _ . or -, got {name!r:.80}")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ValidationError(f"{field}.function.parameters", f"{field}.function.parameters "
                              f"must be a JSON schema object, got {params!r:.80}")
    out = {"name": name, "parameters": params}
    if isinstance(f.get("description"), str):
        out["description"] = f["description"]
    return out


def _constraint(tc: ToolChoice, funcs: list[dict[str, Any]]) -> StructuredOutput | None:
    if tc.mode == "auto":
        return None
    if tc.mode == "named":
        params = next(f["parameters"] for f in funcs if f["name"] == tc.name)
        return StructuredOutput("json", json.dumps(params))
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for f in funcs]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not tc.parallel:
        schema["maxItems"] = 1
    return StructuredOutput("json", json.dumps(schema))


# -- prompt -----------------------------------------------------------------------------------
def generic_messages(messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation in the generic tool format, for a template without a tool section:
    plain {"role", "content"} messages only."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            content += "".join(f"{TOOL_CALL_OPEN}{json.dumps(call)}{TOOL_CALL_CLOSE}"
                               for call in _calls_as_written(m["tool_calls"]))
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        prompt = GENERIC_TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _calls_as_written(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calls = []
    for call in tool_calls:
        f = call.get("function", {})
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # else written back as the string it was
                args = json.loads(args)
        calls.append({"name": f.get("name"), "arguments": args})
    return calls


async def encode_tool_chat(backend: Backend, messages: list[dict[str, Any]],
                           tools: list[dict[str, Any]], field: str,
                           template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The conversation's prompt: through the template's own tool section when it has one,
    else in the generic format."""
    if backend.tokenizer.template_renders_tools:
        return await encode_chat(backend, messages, field, tools=tools,
                                 template_kwargs=template_kwargs)
    return await encode_chat(backend, generic_messages(messages, tools), field,
                             template_kwargs=template_kwargs)


def tool_calls_to_proto(calls: list[dict[str, Any]]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c["id"], name=c["function"]["name"],
                        arguments=c["function"]["arguments"]) for c in calls]


# -- output -----------------------------------------------------------------------------------
def parse_output(tc: ToolChoice, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a finished output; no calls when none parse (a cut
    output, or an auto answer without tool calls), and then the text is the content."""
    if tc.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(tc.name, text)]
    if tc.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []
        spans = scan_calls(text, 1)
        return None, [_call(c["name"], text[s.args_start:s.args_end])
                      for c, s in zip(calls, spans, strict=True)]
    calls = []
    for block in _BLOCK.findall(text):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if isinstance(value, dict) and value.get("name") in tc.names:
            args = raw_arguments(block)
            calls.append(_call(value["name"], "{}" if args is None else args))
    if not calls:
        return text, []
    head = text[: text.index(TOOL_CALL_OPEN)].rstrip()  # as streamed (tool_stream.py)
    return head or None, calls[: None if tc.parallel else 1]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
