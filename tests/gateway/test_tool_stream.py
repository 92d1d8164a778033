"""Tool calls streamed as deltas (gateway/openai/tool_stream.py), fed any way the text is cut: the
deltas join into the calls a non-streamed response parses, the first delta of a call
carries its index, id, type and name, content streams before the first call."""

from __future__ import annotations

import json

import pytest

from gateway.openai.tool_stream import ToolStream, scan_calls
from gateway.openai.tools import ToolChoice, parse_output

NAMES = ("get_weather", "get_time")
AUTO = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
        '{"tz": "CET"}}</tool_call>')
REQUIRED = '[{"name":"get_time","arguments":{"tz":"a\\"}b"}},{"name":"get_weather","arguments":{}}]'
NAMED = '{"city": "Rome", "days": [1, 2]}'
SPACED = " " + AUTO.replace("check. ", "check.\n\n")  # the leading space is content
CASES = [(ToolChoice("auto", NAMES), AUTO), (ToolChoice("auto", NAMES, parallel=False), AUTO),
         (ToolChoice("auto", NAMES), SPACED), (ToolChoice("required", NAMES), REQUIRED),
         (ToolChoice("named", NAMES, "get_weather"), NAMED)]


def stream(tc: ToolChoice, text: str, step: int) -> tuple[str, list[dict]]:
    s = ToolStream(tc)
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = s.feed(text[i:i + step])
        content += c
        deltas += d
    c, d = s.finish()
    return content + c, deltas


def join(deltas: list[dict]) -> list[dict]:
    """What the openai client does with streamed tool_calls."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            assert set(d) == {"index", "id", "type", "function"}, d  # the first delta
            call = calls[d["index"]] = {"id": d["id"], "type": d["type"], "function": {
                "name": d["function"]["name"], "arguments": ""}}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        call["function"]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("tc,text", CASES, ids=["auto", "auto-single", "auto-spaced", "required",
                                                   "named"])
def test_deltas_join_into_the_parsed_calls(tc, text, step):
    content, deltas = stream(tc, text, step)
    want_content, want = parse_output(tc, text)
    got = join(deltas)
    assert [c["function"] for c in got] == [c["function"] for c in want]
    assert content == (want_content or "")  # the space before the first call dropped
    for call in got:
        json.loads(call["function"]["arguments"])
    if step == 1 and tc.mode == "auto":  # arguments arrive in fragments, not whole
        assert len(deltas) > len(got) + 5


def test_no_call_is_plain_content():
    tc = ToolChoice("auto", NAMES)
    for text in ("Sunny, 20 degrees.", "a <tool_call>{\"name\": \"nope\"}</tool_call>",
                 "a <tool_", " Two lines,\n then spaces.  \n"):
        content, deltas = stream(tc, text, 3)
        assert content == text and deltas == []


def test_scan_calls_reads_a_cut_text():
    text = '[{"name": "f", "arguments": {"x": [1, "}"]}}, {"name": "g", "argu'
    a, b = scan_calls(text, 1)
    assert (a.name, text[a.args_start:a.args_end], a.is_closed) == ("f", '{"x": [1, "}"]}', True)
    assert (b.name, b.args_start, b.is_closed) == ("g", None, False)
