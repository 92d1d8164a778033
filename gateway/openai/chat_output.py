"""A chat choice's output text as OpenAI's message: its reasoning (gateway/openai/reasoning.py's
think parser, or GPT-OSS's harmony channels: gateway/openai/harmony.py), its content and its tool
calls (gateway/openai/tools.py, gateway/openai/tool_stream.py), whole or as it streams.

    parser    reasoning from               tool calls from
    none      -                            the content (<tool_call> blocks, required/named)
    think     <think> ... </think>         the content after the reasoning
    harmony   the analysis channel         commentary messages to functions.NAME (auto);
                                           the content under required/named, whose
                                           constraint leaves no harmony headers
"""

from __future__ import annotations

from typing import Any

from gateway.openai import harmony
from gateway.openai.reasoning import TAGS, ReasoningSplit
from gateway.openai.reasoning import split as split_think
from gateway.openai.tool_stream import ToolStream
from gateway.openai.tools import ToolChoice, parse_output


def _harmony_tools(tc: ToolChoice | None) -> frozenset[str]:
    return frozenset(tc.names) if tc is not None and tc.mode == "auto" else frozenset()


def chat_message(text: str, parser: str | None, reasoning_open: bool,
                 tc: ToolChoice | None) -> tuple[dict[str, Any], bool]:
    """(the assistant message of a finished output, whether it holds tool calls)."""
    calls: list[dict[str, Any]] = []
    if parser == "harmony":
        reasoning, content, calls = harmony.parse(text, _harmony_tools(tc))
    elif parser in TAGS:
        reasoning, content = split_think(text, reasoning_open, TAGS[parser])
    else:
        reasoning, content = None, text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tc is not None and not calls and not (parser == "harmony" and tc.mode == "auto"):
        content, calls = parse_output(tc, content or "")
        message["content"] = content if calls else message["content"]
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


class ChatStream:
    """One streamed chat choice: `feed` each text delta and `finish` at its end; each returns
    (reasoning delta, content delta, OpenAI tool_calls deltas)."""

    def __init__(self, parser: str | None, reasoning_open: bool, tc: ToolChoice | None) -> None:
        self.harmony = harmony.HarmonyStream(_harmony_tools(tc)) if parser == "harmony" \
            else None
        self.think = ReasoningSplit(reasoning_open, TAGS[parser]) if parser in TAGS else None
        harmony_calls = parser == "harmony" and tc is not None and tc.mode == "auto"
        self.tools = ToolStream(tc) if tc is not None and not harmony_calls else None

    @property
    def has_calls(self) -> bool:
        return bool(self.harmony is not None and self.harmony.calls) or bool(
            self.tools is not None and self.tools.has_calls)

    def calls(self) -> list[dict[str, Any]]:
        """The calls made so far, whole (OpenAI tool_calls entries)."""
        if self.harmony is not None and self.harmony.calls:
            return self.harmony.calls
        return self.tools.sent_calls() if self.tools is not None else []

    def feed(self, delta: str) -> tuple[str, str, list[dict[str, Any]]]:
        return self._route(*self._split(delta, last=False), last=False)

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        return self._route(*self._split("", last=True), last=True)

    def _split(self, delta: str, last: bool) -> tuple[str, str, list[dict[str, Any]]]:
        if self.harmony is not None:
            if not last:
                return self.harmony.feed(delta)
            return self.harmony.finish()
        if self.think is not None:
            return (*(self.think.finish() if last else self.think.feed(delta)), [])
        return "", delta, []

    def _route(self, reasoning: str, content: str, calls: list[dict[str, Any]],
               last: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """The content through the tool parser, where the calls come from the content."""
        if self.tools is None:
            return reasoning, content, calls
        content, calls = self.tools.feed(content)
        if last:
            rest, last_calls = self.tools.finish()
            content, calls = content + rest, calls + last_calls
        return reasoning, content, calls
