"""OpenAI's Responses API (POST /v1/responses, gateway/openai/responses_api.py) through a real gateway
and the official `openai` client: the same output as the chat completion it stands for, its
stream accumulated by the client's own strict helper (`client.responses.stream`) into the
non-streamed response, logprobs, structured output, function calls and their results,
reasoning items from a thinking template and GPT-OSS's channels, and 400s naming this API's
fields."""

from __future__ import annotations

import json
import re

import httpx2 as httpx
import jsonschema
import pytest

from tests.gateway.conftest import openai_client
from tests.structured_schemas import ASK, SCHEMAS, TOOL_SCHEMAS, TOOLS

MODEL = "SmolLM2-135M-Instruct"
CONV = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."}]
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]  # this API's flat form


@pytest.fixture(scope="module")
def client(gateway):
    yield from openai_client(gateway)


def chat(gw, messages, **body) -> dict:
    r = httpx.post(f"{gw.http_url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "temperature": 0.0, **body}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_response_is_the_chat_completion_it_stands_for(client, gateway):
    """instructions and a developer message are system messages; the output text, its length
    cut (incomplete, max_output_tokens) and the token counts are the chat completion's."""
    want = chat(gateway, CONV, max_tokens=12)
    resp = client.responses.create(model=MODEL, instructions="You are terse.",
                                   input="Name three colours.", max_output_tokens=12,
                                   temperature=0.0)
    assert resp.output_text == want["choices"][0]["message"]["content"]
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert resp.usage.output_tokens == want["usage"]["completion_tokens"] == 12
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    items = client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "You are terse."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Name three colours."}]}],
        max_output_tokens=12, temperature=0.0)
    assert items.output_text == resp.output_text
    whole = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=200,
                                    temperature=0.0, metadata={"run": "a"})
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.metadata == {"run": "a"} and whole.store is False
    assert whole.usage.output_tokens_details.reasoning_tokens == 0  # no reasoning parser
    gateway.wait_idle()


def test_the_stream_accumulates_to_the_whole_response(client, gateway):
    """The client's own stream helper checks each item's added / done events and the output
    identities; what it accumulates is the non-streamed response."""
    kwargs = dict(model=MODEL, input=CONV, max_output_tokens=200, temperature=0.0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    # cut by the length limit: the stream ends with response.incomplete, as OpenAI's does
    cut = list(client.responses.create(**{**kwargs, "max_output_tokens": 4}, stream=True))
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.output[0].content[0].text == "".join(
        e.delta for e in cut if e.type == "response.output_text.delta")
    gateway.wait_idle()


def test_logprobs_whole_and_streamed(client, gateway):
    """include message.output_text.logprobs with top_logprobs: every output token's logprob
    and its alternatives on the output_text part, the chat completion's for the same request;
    streamed, each output_text delta carries its tokens' and they join to the whole list;
    top_logprobs alone asks for them too; another include value adds nothing."""
    want = chat(gateway, CONV, max_tokens=16, logprobs=True, top_logprobs=2)
    want_lps = want["choices"][0]["logprobs"]["content"]
    kwargs = dict(model=MODEL, input=CONV, max_output_tokens=16, temperature=0.0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    resp = client.responses.create(**kwargs)
    got = resp.output[0].content[0].logprobs
    assert len(got) == resp.usage.output_tokens == len(want_lps) > 4
    assert [g.token for g in got] == [w["token"] for w in want_lps]
    for g, w in zip(got, want_lps, strict=True):  # (a prefix-cache hit moves the last bits)
        assert bytes(g.bytes) == g.token.encode() and len(g.top_logprobs) == 2
        assert abs(g.logprob - w["logprob"]) < 1e-3 and g.top_logprobs[0].logprob >= g.logprob
        assert [t.token for t in g.top_logprobs] == [t["token"] for t in w["top_logprobs"]]
    assert resp.top_logprobs == 2
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    # each delta carries its tokens'; the end token has no text, so no delta: the done event
    # and the part hold every token's
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [g.token for g in got[:-1]]
    assert got[-1].token == "<|im_end|>"
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.logprob for lp in done.logprobs] == [g.logprob for g in got]
    assert [lp.token for lp in final.output[0].content[0].logprobs] == [g.token for g in got]
    alone = client.responses.create(**{**kwargs, "include": None, "top_logprobs": 1})
    assert [g.token for g in alone.output[0].content[0].logprobs] == [g.token for g in got]
    plain = client.responses.create(**{**kwargs, "include": ["reasoning.encrypted_content"],
                                       "top_logprobs": 0})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == resp.output_text
    gateway.wait_idle()


def test_a_json_schema_format(client, gateway):
    schema = SCHEMAS["person"]
    resp = client.responses.create(
        model=MODEL, input="Describe a person as JSON.", max_output_tokens=120, temperature=0.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), schema)
    gateway.wait_idle()


def test_function_calls_and_their_results(client, gateway):
    named = client.responses.create(
        model=MODEL, input=ASK[0]["content"], tools=FUNCTIONS, max_output_tokens=80,
        temperature=0.0, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS["get_weather"])
    with client.responses.stream(model=MODEL, input=ASK[0]["content"], tools=FUNCTIONS,
                                 max_output_tokens=80, temperature=0.0,
                                 tool_choice={"type": "function", "name": "get_weather"}
                                 ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == final.output[0].arguments == call.arguments
    # the call and its result go back as input items
    again = client.responses.create(model=MODEL, tools=FUNCTIONS, max_output_tokens=8,
                                    temperature=0.0, input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    assert again.usage.input_tokens > named.usage.input_tokens + 10
    gateway.wait_idle()


AUTO = (r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": '
        r'"Paris", "unit": "celsius"\}\}</tool_call>')


def test_auto_text_then_a_call_streamed_and_not(client, gateway):
    """tool_choice auto (the model held to text then a call by a regex): a message item, then
    a function_call item, in the stream too."""
    kwargs = dict(model=MODEL, input=ASK[0]["content"], tools=FUNCTIONS, max_output_tokens=80,
                  temperature=0.0, extra_body={"structured_outputs": {"regex": AUTO}})
    resp = client.responses.create(**kwargs)
    assert [i.type for i in resp.output] == ["message", "function_call"]
    assert resp.output_text.strip() == "Let me check."
    assert (resp.output[1].name, json.loads(resp.output[1].arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"})
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output_text.strip() == resp.output_text.strip()  # (as the chat API's: the
    # streamed content keeps the space before the call, the whole one is stripped)
    assert final.output[1].arguments == resp.output[1].arguments
    gateway.wait_idle()


THINKING = r"<think>[a-z ]{4,30}</think>\n\n[A-Z][a-z ]{4,30}\."


def test_reasoning_items_from_a_thinking_template(thinking_gateway):
    """The reasoning item first, then the message; streamed as reasoning_text deltas."""
    for c in openai_client(thinking_gateway):
        kwargs = dict(model=MODEL, input="Is the sky blue?", max_output_tokens=80,
                      temperature=0.0, extra_body={"structured_outputs": {"regex": THINKING}})
        resp = c.responses.create(**kwargs)
        with c.responses.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_response()
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert re.fullmatch(r"[a-z ]{4,30}", reasoning.content[0].text)
    assert re.fullmatch(r"[A-Z][a-z ]{4,30}\.", resp.output_text)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == resp.output_text and resp.status == "completed"
    # the tokens of <think> and the reasoning count apart; </think>'s and the answer's not
    details = resp.usage.output_tokens_details
    tag = len(thinking_gateway_tokens("<think>"))
    assert tag < details.reasoning_tokens < resp.usage.output_tokens - 3
    assert final.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    thinking_gateway.wait_idle()


def thinking_gateway_tokens(text: str) -> list[int]:
    """`text` in the served model's tokens."""
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None)).encode(text, add_special_tokens=False)


def test_gpt_oss_channels_and_reasoning_effort(harmony_gateway):
    regex = (r"<\|channel\|>analysis<\|message\|>[a-z ]{4,20}<\|end\|><\|start\|>assistant"
             r"<\|channel\|>final<\|message\|>[A-Z][a-z ]{4,30}\.")
    for c in openai_client(harmony_gateway):
        kwargs = dict(model=MODEL, input="Is the sky blue?", max_output_tokens=80,
                      temperature=0.0, extra_body={"structured_outputs": {"regex": regex}})
        resp = c.responses.create(**kwargs)
        high = c.responses.create(**kwargs, reasoning={"effort": "high"})
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert re.fullmatch(r"[a-z ]{4,20}", resp.output[0].content[0].text)
    assert re.fullmatch(r"[A-Z][a-z ]{4,30}\.", resp.output_text)
    assert high.usage.input_tokens > resp.usage.input_tokens  # the template's system line
    # the analysis message's tokens count apart, the final one's not
    analysis = len(thinking_gateway_tokens(resp.output[0].content[0].text))
    assert analysis < resp.usage.output_tokens_details.reasoning_tokens < \
        resp.usage.output_tokens - len(thinking_gateway_tokens(resp.output_text))
    harmony_gateway.wait_idle()


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"input": "hi", "tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice"),
    ({"input": "hi", "model": "gpt-4"}, 404, "model"),
    ({"input": "hi", "include": ["message.output_text.logprobs", "everything"]}, 400,
     "include[1]"),
    ({"input": "hi", "include": "message.output_text.logprobs"}, 400, "include"),
    ({"input": "hi", "top_logprobs": 21}, 400, "top_logprobs"),
])
def test_bad_requests_name_this_apis_fields(gateway, body, status, param):
    r = httpx.post(f"{gateway.http_url}/v1/responses", json={"model": MODEL, **body},
                   timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    gateway.wait_idle()
