"""A thinking chat over the gRPC API (gateway/openai/grpc_chat.py): GenerateResponse.reasoning apart
from the content in `text`, per sample, tool calls from the content after the reasoning,
chat_template_kwargs_json and reasoning_effort reaching the template, GPT-OSS's harmony
channels; through the real gateways of tests/gateway/conftest.py (the real model held to a
thinking shape by a regex), against the HTTP API's split of the same output."""

from __future__ import annotations

import argparse
import io
import json
import re

import grpc
import httpx2 as httpx
import pytest

from gateway.client import run_generate
from protos.pdserve.v1 import generate_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "Is the sky blue? Think first."
THINKING = r"<think>[a-z ]{4,30}</think>\n\n[A-Z][a-z ]{4,30}\."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def generate(gw, regex: str, n: int = 1, temperature: float = 0.0,
             **chat) -> dict[int, list[pb.GenerateResponse]]:
    """Each sample's messages of one gRPC chat, by index."""
    messages = pb.ChatMessages(**chat)
    messages.messages.add(role="user", content=QUESTION)
    req = pb.GenerateRequest(chat=messages, n=n, sampling=pb.SamplingParameters(
        max_tokens=80, temperature=temperature, seed=1,
        structured=pb.StructuredOutput(regex=regex)))
    samples: dict[int, list[pb.GenerateResponse]] = {}
    with gw.channel() as channel:
        for msg in gw.stub(channel).Generate(req, timeout=180):
            samples.setdefault(msg.index, []).append(msg)
    return samples


def joined(msgs: list[pb.GenerateResponse]) -> tuple[str, str]:
    return "".join(m.reasoning for m in msgs), "".join(m.text for m in msgs)


def http_message(gw, regex: str, **body) -> dict:
    r = httpx.post(f"{gw.http_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 80, "temperature": 0.0, "structured_outputs": {"regex": regex}, **body},
        timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_grpc_reasoning_apart_from_the_content(thinking_gateway):
    (msgs,) = generate(thinking_gateway, THINKING).values()
    reasoning, content = joined(msgs)
    assert re.fullmatch(r"[a-z ]{4,30}", reasoning) and re.fullmatch(r"[A-Z][a-z ]{4,30}\.",
                                                                      content)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    want = http_message(thinking_gateway, THINKING)["message"]  # greedy: the same output
    assert (reasoning, content) == (want["reasoning_content"], want["content"])
    # two samples interleave; each splits on its own
    samples = generate(thinking_gateway, THINKING, n=2, temperature=1.0)
    assert sorted(samples) == [0, 1]
    for msgs in samples.values():
        reasoning, content = joined(msgs)
        assert re.fullmatch(r"[a-z ]{4,30}", reasoning), reasoning
        assert re.fullmatch(r"[A-Z][a-z ]{4,30}\.", content), content
    thinking_gateway.wait_idle()


def test_grpc_template_variables_and_their_errors(thinking_gateway):
    """open_thinking (a chat_template_kwargs_json variable) ends the prompt inside <think>: the
    output up to </think> is reasoning without an opening tag; enable_thinking false adds
    Qwen3's empty think block to the prompt. Bad values are INVALID_ARGUMENT naming the
    field."""
    (msgs,) = generate(thinking_gateway, r"[a-z ]{4,30}</think>\n\n[A-Z][a-z ]{4,30}\.",
                       chat_template_kwargs_json='{"open_thinking": true}').values()
    reasoning, content = joined(msgs)
    assert re.fullmatch(r"[a-z ]{4,30}", reasoning) and re.fullmatch(r"[A-Z][a-z ]{4,30}\.",
                                                                      content)
    plain = generate(thinking_gateway, THINKING)[0][-1].usage.prompt_tokens
    closed = generate(thinking_gateway, r"[A-Z][a-z ]{4,30}\.",
                      chat_template_kwargs_json='{"enable_thinking": false}')[0]
    assert closed[-1].usage.prompt_tokens > plain
    assert joined(closed)[0] == ""  # the prompt closed the block: all content
    for chat, field in (({"chat_template_kwargs_json": "[1]"}, "chat.chat_template_kwargs_json"),
                        ({"chat_template_kwargs_json": "{oops"},
                         "chat.chat_template_kwargs_json"),
                        ({"chat_template_kwargs_json": '{"add_generation_prompt": false}'},
                         "chat.chat_template_kwargs_json"),
                        ({"reasoning_effort": "extreme"}, "chat.reasoning_effort")):
        with pytest.raises(grpc.RpcError) as e:
            generate(thinking_gateway, THINKING, **chat)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(e.value.trailing_metadata())["pdserve-invalid-field"] == field
    thinking_gateway.wait_idle()


def test_grpc_tool_call_after_the_reasoning(thinking_gateway):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    (msgs,) = generate(thinking_gateway, r"<think>[a-z ]{4,20}</think>\n\n" + re.escape(call),
                       tools_json=json.dumps(TOOLS)).values()
    reasoning, content = joined(msgs)
    assert re.fullmatch(r"[a-z ]{4,20}", reasoning) and content.strip() == ""
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    (got,) = last.tool_calls
    assert (got.name, json.loads(got.arguments)) == ("get_weather", {"city": "Paris"})
    deltas = [d for m in msgs for d in m.tool_call_deltas]
    assert (deltas[0].id, deltas[0].name) == (got.id, "get_weather")
    assert "".join(d.arguments for d in deltas) == got.arguments
    thinking_gateway.wait_idle()


def test_grpc_harmony_channels_and_reasoning_effort(harmony_gateway):
    """The analysis channel is the reasoning and final the content: the channels are special
    tokens, which a harmony chat's text keeps (else they vanish before the parser)."""
    regex = (r"<\|channel\|>analysis<\|message\|>[a-z ]{4,20}<\|end\|><\|start\|>assistant"
             r"<\|channel\|>final<\|message\|>[A-Z][a-z ]{4,30}\.")
    (msgs,) = generate(harmony_gateway, regex).values()
    reasoning, content = joined(msgs)
    assert re.fullmatch(r"[a-z ]{4,20}", reasoning) and re.fullmatch(r"[A-Z][a-z ]{4,30}\.",
                                                                      content)
    want = http_message(harmony_gateway, regex)["message"]
    assert (reasoning, content) == (want["reasoning_content"], want["content"])
    effort = generate(harmony_gateway, regex, reasoning_effort="high")[0]
    assert effort[-1].usage.prompt_tokens > msgs[-1].usage.prompt_tokens  # the system line
    harmony_gateway.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_pdserve_generate_prints_the_reasoning_to_stderr(thinking_gateway, stream):
    """`pdserve generate --chat` against a thinking model, its prompt ending inside <think>
    (--chat-template-kwargs): the answer on stdout, the reasoning on stderr, as the HTTP API
    splits the same greedy output."""
    kwargs = {"open_thinking": True}
    args = argparse.Namespace(
        gateway=thinking_gateway.grpc_addr, prompt=QUESTION, chat=True, model="",
        chat_template_kwargs=json.dumps(kwargs), max_tokens=24, temperature=0.0, top_p=None,
        seed=None, stream=stream, timing=False, timeout=180, api_key=None, tls_ca=None,
        tls_cert=None, tls_key=None)
    out, err = io.StringIO(), io.StringIO()
    assert run_generate(args, out, err) == 0
    r = httpx.post(f"{thinking_gateway.http_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
        "temperature": 0.0, "chat_template_kwargs": kwargs}, timeout=180)
    want = r.json()["choices"][0]["message"]
    assert want["reasoning_content"]  # the prompt opened the block: reasoning first
    assert err.getvalue().strip() == want["reasoning_content"].strip()
    assert out.getvalue().strip() == (want["content"] or "").strip()
    thinking_gateway.wait_idle()
