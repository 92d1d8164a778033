"""Tool calls streamed as OpenAI `tool_calls` deltas, parsed from a choice's text as it grows.

    text before a call  -> content, as it comes (a suffix that may begin `<tool_call>`, and
                           trailing whitespace, are held back until it is known not to; the
                           whitespace before a call is dropped)
    a call's name done  -> {"index": k, "id": "call_...", "type": "function",
                            "function": {"name": ..., "arguments": ""}}
    its arguments grow  -> {"index": k, "function": {"arguments": <the new characters>}}

Where calls are (gateway/openai/tools.py's tool_choice modes): `auto` writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional content;
`required` writes a JSON array of {"name", "arguments"} objects; a named function's output is
its arguments object alone. The arguments fragments are the model's own text of the
arguments value, so they concatenate to the `arguments` a non-streamed response carries
(`raw_arguments`). An output cut short (finish_reason "length") leaves its last call's
arguments incomplete, as a streamed OpenAI response does.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # the generic format accepts either


@dataclass
class CallSpan:
    """One call object found in a text: its name once written, where its arguments value
    starts and (once written) ends."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    is_closed: bool = False  # the object's closing brace is written


def scan_calls(text: str, call_depth: int, max_calls: int | None = None) -> list[CallSpan]:
    """The call objects that open at nesting depth `call_depth` of `text` (0: the text is an
    object; 1: an array of them), read as far as the text goes. Tolerates a text cut
    anywhere; does not validate the JSON (json.loads does, once it is complete).

        [{"name": "f", "arguments": {"x": 1}}, {"name": ...
         ^ depth 1    ^ key at depth 2       ^ args_end
                                    ^ args_start
    """
    calls: list[CallSpan] = []
    depth, i, n = 0, 0, len(text)
    key: str | None = None  # the current call's key whose value is being read
    while i < n:
        ch = text[i]
        in_call = depth == call_depth + 1 and bool(calls) and not calls[-1].is_closed
        if ch == '"':
            end = _string_end(text, i)
            if end is None:  # cut inside a string
                return calls
            if in_call and key is None:
                j = _skip_space(text, end)
                if j == n:  # a key or not: the next character tells
                    return calls
                if text[j] == ":":
                    key = _loads(text[i:end])
                    j = _skip_space(text, j + 1)
                    if key in ARGUMENT_KEYS:
                        calls[-1].args_start = j
                    i = j
                    continue
            elif in_call and key == "name":
                name = _loads(text[i:end])
                calls[-1].name = name if isinstance(name, str) else None
            elif in_call and key in ARGUMENT_KEYS:
                calls[-1].args_end = end
            i = end
            continue
        if ch in "{[":
            if depth == call_depth and ch == "{":
                if max_calls is not None and len(calls) == max_calls:
                    return calls
                calls.append(CallSpan())
                key = None
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == call_depth + 1 and calls and key in ARGUMENT_KEYS:
                calls[-1].args_end = i + 1  # an object or array value ends
            elif depth == call_depth and calls:
                _end_primitive(calls[-1], key, text, i)
                calls[-1].is_closed = True
                key = None
        elif ch == "," and in_call:
            _end_primitive(calls[-1], key, text, i)
            key = None
        i += 1
    return calls


def _end_primitive(call: CallSpan, key: str | None, text: str, i: int) -> None:
    """A number / true / false / null arguments value ends before text[i]."""
    if key in ARGUMENT_KEYS and call.args_start is not None and call.args_end is None:
        call.args_end = len(text[:i].rstrip())


def _string_end(text: str, start: int) -> int | None:
    """Index after the string that opens at text[start] ('"'), or None if it is cut."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return None


def raw_arguments(text: str) -> str | None:
    """The text of the arguments value of the one call object `text` holds (None: none)."""
    calls = scan_calls(text, 0, max_calls=1)
    if not calls or calls[0].args_start is None or calls[0].args_end is None:
        return None
    return text[calls[0].args_start:calls[0].args_end]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Sent:
    """What one call has streamed so far."""

    id: str
    name: str
    arguments: str = ""  # its arguments text so far


@dataclass
class ToolStream:
    """One streamed choice of a chat with tools (gateway/openai/tools.py's ToolChoice)."""

    tc: Any  # gateway.openai.tools.ToolChoice (mode, names, name, parallel)
    text: str = ""
    num_sent: int = 0  # characters of `text` sent as content
    calls: list[_Sent] = field(default_factory=list)

    @property
    def in_calls(self) -> bool:
        return self.tc.mode != "auto" or TOOL_CALL_OPEN in self.text

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(the content to send now, the tool_calls deltas to send now)."""
        self.text += delta
        return self._content(), self._call_deltas()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the choice's end: (the content not sent yet, the last tool_calls deltas). With
        no call sent, every character not sent yet is content."""
        deltas = self._call_deltas()
        if self.calls:
            return "", deltas
        rest = self.text[self.num_sent:]
        self.num_sent = len(self.text)
        return rest, []

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def sent_calls(self) -> list[dict[str, Any]]:
        """The calls streamed so far, whole (OpenAI tool_calls entries, the same ids)."""
        return [{"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]

    def _content(self) -> str:
        """Content up to the first call, less its trailing whitespace (held back until more
        content follows: a call drops it, as parse_output does)."""
        if self.tc.mode != "auto":
            return ""
        start = self.text.find(TOOL_CALL_OPEN)
        if start >= 0:
            end = start
        else:  # hold back a suffix that may begin the tag
            end = len(self.text)
            for k in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text) - self.num_sent), 0,
                           -1):
                if TOOL_CALL_OPEN.startswith(self.text[-k:]):
                    end = len(self.text) - k
                    break
        end = max(len(self.text[:end].rstrip()), self.num_sent)
        out = self.text[self.num_sent:end]
        self.num_sent = end
        return out

    def _call_deltas(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for k, (name, args) in enumerate(self._calls_so_far()):
            if name is None:
                break  # calls stream in order: a later one waits for this one's name
            if k == len(self.calls):
                self.calls.append(_Sent(new_call_id(), name))
                deltas.append({"index": k, "id": self.calls[k].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            sent = self.calls[k]
            if len(args) > len(sent.arguments):
                fragment = args[len(sent.arguments):]
                sent.arguments = args
                if deltas and deltas[-1]["index"] == k:
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": k, "function": {"arguments": fragment}})
        return deltas

    def _calls_so_far(self) -> list[tuple[str | None, str]]:
        """(name or None while unknown, the arguments text so far) of each call so far."""
        tc = self.tc
        if tc.mode == "named":
            return [(tc.name, self.text)]
        if tc.mode == "required":
            spans = [(s, self.text) for s in scan_calls(self.text, 1)]
        else:
            spans = []
            for block in self.text.split(TOOL_CALL_OPEN)[1:]:
                body = block.split(TOOL_CALL_CLOSE, 1)[0]
                found = scan_calls(body, 0, max_calls=1)
                if found and (found[0].name is None or found[0].name in tc.names):
                    spans.append((found[0], body))
        if not tc.parallel:
            spans = spans[:1]
        out = []
        for span, text in spans:
            if span.args_start is None:
                out.append((span.name, ""))
            else:
                out.append((span.name, text[span.args_start:span.args_end]))
        return out
