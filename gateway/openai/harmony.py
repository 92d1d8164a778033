"""GPT-OSS's output in OpenAI's harmony format, as a chat response: the `analysis` channel is
the reasoning (reasoning_content), `final` (and `commentary` addressed to no one, a preamble)
the content, and a `commentary` message to `functions.NAME` a tool call whose arguments are
its text.

The prompt ends with `<|start|>assistant`, so the output opens with the first message's
header; each later message starts with `<|start|>assistant`:

    <|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>C
    <|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}

A header holds the channel after `<|channel|>` and the recipient as `to=...`, before or after
it; `<|end|>`, `<|return|>` and `<|call|>` end a message (the last two stop the model, so they
are mostly absent from the text). The text must keep these special tokens: the gateway asks
the engine not to skip them for such requests. An output that does not open with a header (a
structured output's, which constrains the whole text) is all content, and so is what follows
an end token other than the next message's start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.openai.tool_stream import new_call_id

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
ENDS = (END, "<|return|>", "<|call|>")
NEXT = START + "assistant"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass
class _Message:
    kind: str  # "reasoning", "content" or "call"
    call: int = -1  # the call's index among the output's calls


class HarmonyStream:
    """One choice's output as it streams: `feed` each delta, then `finish`; each returns
    (reasoning delta, content delta, OpenAI tool_calls deltas). Text that may be the start of
    a special token is held back until the next delta tells. `tools`: the names a
    `functions.NAME` recipient may call (a message to any other is content)."""

    def __init__(self, tools: frozenset[str] = frozenset()) -> None:
        self.tools = tools
        self.state = "header"  # "header", "body", "between" (after <|end|>), "plain"
        self.held = ""
        self.message: _Message | None = None
        self.calls: list[dict[str, Any]] = []  # OpenAI tool_calls, whole
        self.saw_reasoning = self.saw_header = False

    def feed(self, delta: str) -> tuple[str, str, list[dict[str, Any]]]:
        text, self.held = self.held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while text:
            if self.state == "plain":
                content.append(text)
                break
            if self.state == "between":
                if text.startswith(NEXT):
                    text, self.state = text[len(NEXT):], "header"
                    continue
                if NEXT.startswith(text):
                    self.held = text
                    break
                self.state = "plain"  # not harmony after all: the rest is content
                continue
            if self.state == "header":
                at = text.find(MESSAGE)
                if not self._may_be_header(text if at < 0 else text[:at]):
                    self.state = "plain"
                    continue
                if at < 0:
                    self.held = text
                    break
                self._open(text[:at], calls)
                text, self.state = text[at + len(MESSAGE):], "body"
                continue
            end, which = min(((text.find(e), e) for e in ENDS if e in text),
                             default=(-1, ""))
            body = text if end < 0 else text[:end]
            if end < 0:  # hold back what may start an end token
                keep = _partial_suffix(body)
                body, self.held = body[:len(body) - keep], body[len(body) - keep:]
                text = ""
            else:
                text = text[end + len(which):]
                self.state = "between"
            self._emit(body, reasoning, content, calls)
        return "".join(reasoning), "".join(content), calls

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """What is held back, as the text it turned out to be."""
        text, self.held = self.held, ""
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self.state == "body":
            self._emit(text, reasoning, content, calls)
        elif self.state in ("plain", "between") or (
                self.state == "header" and not self.saw_header
                and not text.lstrip().startswith((CHANNEL, "to="))):
            content.append(text)  # not harmony after all (a header cut short is dropped)
        return "".join(reasoning), "".join(content), calls

    def _may_be_header(self, text: str) -> bool:
        """Whether `text` (up to <|message|>, or all of it before one comes) is, or can still
        become, a message header: the first one opens with <|channel|> or to= (a recipient),
        after leading whitespace; a later one (after <|start|>assistant) is any text."""
        head = text.lstrip()
        return (self.saw_header or head.startswith((CHANNEL, "to="))
                or CHANNEL.startswith(head) or "to=".startswith(head))

    def _open(self, header: str, calls: list[dict[str, Any]]) -> None:
        self.saw_header = True
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1).removeprefix("functions.") if recipient else None
        if recipient and recipient.group(1).startswith("functions.") and name in self.tools:
            index = len(self.calls)
            call = {"id": new_call_id(), "type": "function",
                    "function": {"name": name, "arguments": ""}}
            self.calls.append(call)
            calls.append({"index": index, **call,
                          "function": {"name": name, "arguments": ""}})
            self.message = _Message("call", index)
        elif channel and channel.group(1) == "analysis":
            self.message, self.saw_reasoning = _Message("reasoning"), True
        else:
            self.message = _Message("content")

    def _emit(self, body: str, reasoning: list[str], content: list[str],
              calls: list[dict[str, Any]]) -> None:
        if not body or self.message is None:
            return
        if self.message.kind == "reasoning":
            reasoning.append(body)
        elif self.message.kind == "content":
            content.append(body)
        else:
            self.calls[self.message.call]["function"]["arguments"] += body
            calls.append({"index": self.message.call, "function": {"arguments": body}})


def parse(text: str, tools: frozenset[str] = frozenset()
          ) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """(reasoning_content, content, tool_calls) of a finished output; None where there is
    none (content: the whole text when it is not harmony)."""
    stream = HarmonyStream(tools)
    reasoning, content, _ = stream.feed(text)
    more_reasoning, more_content, _ = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    if not stream.saw_header:
        return None, content, []
    return (reasoning if stream.saw_reasoning else None), content or None, stream.calls


def _partial_suffix(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of an end token."""
    at = text.rfind("<")
    if at < 0 or len(text) - at >= max(map(len, ENDS)):
        return 0
    tail = text[at:]
    return len(tail) if any(e.startswith(tail) and e != tail for e in ENDS) else 0
