"""Tool calling through a real colocated gateway with the official `openai` client (and the
same over gRPC, ChatMessages.tools_json / tool_choice_json): a named
tool_choice and `required` are enforced by the tools' schemas (parallel or not), `auto` parses
the calls the model writes, streamed as tool_calls deltas; tool results go back through the
conversation; bad tools / tool_choice are a 400 naming the field."""

from __future__ import annotations

import json
import re

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from tests.structured_schemas import ASK, TOOL_SCHEMAS, TOOLS

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=f"{gateway.http_url}/v1", api_key="unused", timeout=180,
                       max_retries=0) as c:
        yield c


def _check_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_named_and_required_are_enforced(client, gateway):
    for temperature in (0.0, 1.0):
        named = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=temperature,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, ("get_time",))
        single = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=temperature,
            tool_choice="required", parallel_tool_calls=False)
        assert single.choices[0].finish_reason == "tool_calls"
        assert len(single.choices[0].message.tool_calls) == 1
        _check_calls(single.choices[0].message.tool_calls)
        many = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=temperature,
            tool_choice="required", seed=5)
        assert many.choices[0].finish_reason == "tool_calls"
        _check_calls(many.choices[0].message.tool_calls)
    gateway.wait_idle()


def _joined(deltas):
    """Streamed tool_calls deltas joined by index, as the openai client's helpers do; the
    first delta of a call carries its id, type and name, the others arguments only."""
    calls: dict = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.type == "function" and d.function.name, d
            calls[d.index] = d.model_copy(deep=True)
        else:
            assert d.id is None and d.function.name is None, d
            calls[d.index].function.arguments += d.function.arguments
    return [calls[k] for k in sorted(calls)]


def test_required_streamed_as_tool_calls_deltas(client, gateway):
    req = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.0,
               tool_choice="required", parallel_tool_calls=False)
    stream = client.chat.completions.create(**req, stream=True)
    deltas, finish, content = [], None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    calls = _joined(deltas)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert len(deltas) > 2  # the arguments arrive as they are generated, not whole
    _check_calls(calls)
    whole = client.chat.completions.create(**req).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole]
    # the openai client's own stream helper reassembles the deltas
    with client.chat.completions.stream(**req) as s:
        final = s.get_final_completion()
    assert [c.function.arguments for c in final.choices[0].message.tool_calls] == \
        [c.function.arguments for c in whole]
    gateway.wait_idle()


# the model is too small to call tools by itself: a regex makes it write one, in the generic
# format, after some content; tool_choice auto must parse it back out
AUTO_REGEX = (r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": '
              r'"(Paris|Rome)", "unit": "celsius"\}\}</tool_call>')


def test_auto_parses_calls_streamed_and_not(client, gateway):
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0,
        extra_body={"structured_outputs": {"regex": AUTO_REGEX}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    _check_calls(choice.message.tool_calls, ("get_weather",))
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0, stream=True,
        extra_body={"structured_outputs": {"regex": AUTO_REGEX}})
    content, deltas, finish = "", [], None
    num_content_before_call = None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            if c.delta.tool_calls and num_content_before_call is None:
                num_content_before_call = len(content)
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content.strip() == "Let me check." and "<tool" not in content
    assert num_content_before_call == len(content)  # the content streamed first
    assert finish == "tool_calls" and len(deltas) > 2
    calls = _joined(deltas)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    # no call written: plain content, finish "stop"; tool_choice none: no tools in the prompt
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["Sunny."]}})
    assert plain.choices[0].message.content == "Sunny." and not plain.choices[0].message.tool_calls
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=1, temperature=0.0)
    without = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             tool_choice="none", max_tokens=1, temperature=0.0)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50
    gateway.wait_idle()


def test_tool_results_go_back_into_the_conversation(client, gateway):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    conv = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=conv, tools=TOOLS,
                                            max_tokens=12, temperature=0.0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    gateway.wait_idle()


BAD = [  # (case, body fields, field named)
    ("tools not a list", {"tools": {"a": 1}}, "tools"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools[0]"),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ("bad parameters schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "banana"}}}], "tool_choice": "required"}, "tools"),
    ("unknown named tool", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("tool_choice garbage", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("parallel_tool_calls not a bool", {"tools": TOOLS, "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
    ("required and response_format", {"tools": TOOLS, "tool_choice": "required",
                                      "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("duplicate names", {"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ("bad tool_calls", {"messages": [{"role": "assistant", "content": "",
                                      "tool_calls": [{"x": 1}]}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("case", "fields", "param"), BAD, ids=[c[0] for c in BAD])
def test_bad_tools_are_http_400(gateway, client, case, fields, param):
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK, **fields}
    resp = httpx.post(f"{gateway.http_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert re.search(r"\S", err["message"])
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage


def test_grpc_tools_named_required_auto_and_bad(gateway):
    def chat(**kw) -> pb.ChatMessages:
        msgs = pb.ChatMessages(tools_json=json.dumps(TOOLS), **kw)
        msgs.messages.add(role="user", content=ASK[0]["content"])
        return msgs

    with gateway.channel() as channel:
        stub = gateway.stub(channel)
        named = list(stub.Generate(pb.GenerateRequest(chat=chat(tool_choice_json=json.dumps(
            {"type": "function", "function": {"name": "get_time"}})),
            sampling=pb.SamplingParameters(max_tokens=60, temperature=1.0)), timeout=120))
        last = named[-1]
        assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS
        assert "".join(m.text for m in named) == "" and len(last.tool_calls) == 1
        assert last.tool_calls[0].name == "get_time" and last.tool_calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(last.tool_calls[0].arguments), TOOL_SCHEMAS["get_time"])
        one = list(stub.Generate(pb.GenerateRequest(
            chat=chat(tool_choice_json='"required"', parallel_tool_calls=False),
            sampling=pb.SamplingParameters(max_tokens=120, temperature=0.0)), timeout=120))
        assert one[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
        assert len(one[-1].tool_calls) == 1
        auto = list(stub.Generate(pb.GenerateRequest(chat=chat(), sampling=pb.SamplingParameters(
            max_tokens=60, temperature=0.0, structured=pb.StructuredOutput(regex=AUTO_REGEX))),
            timeout=120))
        assert "".join(m.text for m in auto).strip() == "Let me check."
        assert [c.name for c in auto[-1].tool_calls] == ["get_weather"]
        # streamed as tool_call_deltas while generated; joined, they are the last tool_calls
        deltas = [d for m in auto for d in m.tool_call_deltas]
        assert len(deltas) > 2 and sum(bool(m.tool_call_deltas) for m in auto) > 2
        assert (deltas[0].index, deltas[0].id, deltas[0].name) == (
            0, auto[-1].tool_calls[0].id, "get_weather")
        assert "".join(d.arguments for d in deltas) == auto[-1].tool_calls[0].arguments
        # the call and its result go back into the conversation
        follow = chat()
        follow.messages.add(role="assistant", tool_calls=[last.tool_calls[0]])
        follow.messages.add(role="tool", tool_call_id=last.tool_calls[0].id, content="12:00")
        again = list(stub.Generate(pb.GenerateRequest(chat=follow, sampling=pb.SamplingParameters(
            max_tokens=2, temperature=0.0)), timeout=120))
        assert again[-1].usage.prompt_tokens > named[-1].usage.prompt_tokens + 10
        for kw, field in (({"tool_choice_json": '"sometimes"'}, "chat.tool_choice"),
                          ({"tool_choice_json": "{oops"}, "chat.tool_choice_json")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(chat=chat(**kw)), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(e.value.trailing_metadata())["pdserve-invalid-field"] == field
        bad = pb.ChatMessages(tools_json="[1]")
        bad.messages.add(role="user", content="hi")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(chat=bad), timeout=60))
        assert dict(e.value.trailing_metadata())["pdserve-invalid-field"] == "chat.tools[0]"
    gateway.wait_idle()
