"""How tools reach the prompt (the real default model's tokenizer, no server): a template with
a tool section renders the tools, calls and results itself; SmolLM2's has none, so the
generic format carries them. And how streamed content is held back at a `<tool_call>`."""

from __future__ import annotations

import copy
import json

import pytest

from engine_core.model_files import resolve_model
from engine_core.tokenizer import Tokenizer, load_tokenizer
from gateway.openai.tool_stream import ToolStream
from gateway.openai.tools import ToolChoice, generic_messages, parse_output

TOOL = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
CONV = [{"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
# a template with a tool section, in the style of Qwen's / Hermes'
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments }}{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(resolve_model(str(model_path)))


def test_template_without_tools_uses_the_generic_format(tokenizer):
    assert not tokenizer.template_renders_tools
    msgs = generic_messages(CONV, [TOOL])
    text = tokenizer.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(TOOL["function"]) in text
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in text
    # an existing system message keeps its words, the tools follow them
    sys_first = generic_messages([{"role": "system", "content": "Be brief."}, *CONV], [TOOL])
    assert sys_first[0]["content"].startswith("Be brief.\n\nYou may call")
    assert generic_messages(CONV, [])[0] == CONV[0]  # tool_choice none: no tool prompt


def test_template_with_a_tool_section_renders_them_itself(tokenizer):
    hf = copy.deepcopy(tokenizer.hf)
    hf.chat_template = TOOL_TEMPLATE
    tok = Tokenizer(hf)
    assert tok.template_renders_tools
    ids = tok.apply_chat_template(CONV, tools=[TOOL])
    text = tok.decode(ids, skip_special_tokens=False)
    assert "Tools: get_time" in text and 'CALL get_time {"zone": "UTC"}' in text
    assert "<|im_start|>tool\n12:00" in text


def test_stream_holds_back_a_possible_tag_and_streams_the_calls():
    tc = ToolChoice("auto", ("get_time",))
    s = ToolStream(tc)
    sent = [s.feed(p) for p in ("Sure", ". <to", "ol_call>{\"name\": \"get_time\", ",
                                "\"arguments\": {}}</tool_call>")]
    # the space before the call is held back, then dropped with the call (as parse_output)
    assert [content for content, _ in sent] == ["Sure", ".", "", ""]
    assert [deltas for _, deltas in sent][:2] == [[], []]
    (first,), (args,) = sent[2][1], sent[3][1]
    assert first["index"] == 0 and first["type"] == "function"
    assert first["function"] == {"name": "get_time", "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": "{}"}}
    assert s.finish() == ("", [])
    assert s.sent_calls() == [{"id": first["id"], "type": "function",
                               "function": {"name": "get_time", "arguments": "{}"}}]
    s = ToolStream(tc)  # a "<" that starts no tag is sent once it is clear
    assert s.feed("a <") == ("a", []) and s.feed("b") == (" <b", [])
    assert s.finish() == ("", [])
    # an unknown function name or broken JSON is not a call: the text stays content
    assert parse_output(tc, '<tool_call>{"name": "nope"}</tool_call>')[1] == []
    assert parse_output(tc, "<tool_call>{oops</tool_call>")[1] == []
    one = ToolChoice("auto", ("get_time",), parallel=False)
    two = '<tool_call>{"name": "get_time"}</tool_call>' * 2
    assert len(parse_output(one, two)[1]) == 1 and len(parse_output(tc, two)[1]) == 2
