"""The OpenAI-compatible HTTP API of a real gateway process, through the official `openai`
client and raw HTTP: exact greedy output, SSE streaming with usage, errors in OpenAI's shape,
and a client that disconnects mid-stream."""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
CONV = [{"role": "user", "content": "What is the capital of France?"}]
N = 16  # the same greedy references as test_grpc_api.py (computed once)


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=f"{gateway.http_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def chat_reference(offline):
    return offline.chat(CONV, N).outputs[0]


def test_models_and_health(client, gateway):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{gateway.http_url}/health").json() == {"status": "serving"}


def test_chat_completion_matches_offline_engine(client, chat_reference):
    resp = client.chat.completions.create(model=MODEL, messages=CONV, max_tokens=N,
                                          temperature=0)
    assert resp.choices[0].message.content == chat_reference.text
    assert resp.choices[0].finish_reason == chat_reference.finish_reason
    assert resp.usage.completion_tokens == len(chat_reference.token_ids)


def test_chat_completion_stream(client, chat_reference):
    stream = client.chat.completions.create(model=MODEL, messages=CONV, max_tokens=N,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_reference.text
    assert len([c for c in chunks if c.choices]) > 2  # really streamed
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == chat_reference.finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        chat_reference.token_ids)


def test_chat_stream_with_continuous_usage_and_max_completion_tokens(gateway, chat_reference):
    """Every chunk carries the usage so far (vLLM's continuous_usage_stats); the output
    length comes from max_completion_tokens (max_tokens, if also sent, is overridden)."""
    body = {"model": MODEL, "messages": CONV, "max_completion_tokens": N, "max_tokens": 1,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{gateway.http_url}/v1/chat/completions", json=body,
                      timeout=60) as resp:
        events = [json.loads(line[len("data: "):]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    with_choices = [e for e in events if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] == len(chat_reference.token_ids)
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"]
               for e in with_choices)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in with_choices)
    assert text == chat_reference.text
    assert events[-1]["choices"] == []  # include_usage: the usage-only chunk still ends it


def test_completions_match_offline_engine(client, offline):
    prompt = "The capital of France is"
    ref = offline.generate(prompt, N)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0)
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N,
                                       temperature=0, stream=True, logprobs=1)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == N


BAD_BODIES = [  # (case, path, body, status, param, bound named in the message)
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("prompt of the wrong type", "completions", {"prompt": 5}, 400, "prompt", "string"),
    ("token id outside vocab", "completions", {"prompt": [1, 49152]}, 400, "prompt[1]",
     "[0, 49152)"),
    ("prompt + max_tokens beyond context", "completions", {"prompt": "hi", "max_tokens": 8192},
     400, "max_tokens", "8192"),
    ("max_tokens 0", "completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
     ">= 1"),
    ("max_tokens absurd", "completions", {"prompt": "hi", "max_tokens": 10**12}, 400,
     "max_tokens", "8192"),
    ("max_tokens not an int", "completions", {"prompt": "hi", "max_tokens": "ten"}, 400,
     "max_tokens", "int"),
    ("temperature < 0", "completions", {"prompt": "hi", "temperature": -1}, 400, "temperature",
     ">= 0"),
    ("top_p 0", "completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("top_p 1.5", "chat/completions", {"messages": CONV, "top_p": 1.5}, 400, "top_p",
     "(0, 1]"),
    ("top_k -2", "completions", {"prompt": "hi", "top_k": -2}, 400, "top_k", "-1"),
    ("min_p 1.5", "chat/completions", {"messages": CONV, "min_p": 1.5}, 400, "min_p", "[0, 1]"),
    ("repetition_penalty 0", "completions", {"prompt": "hi", "repetition_penalty": 0}, 400,
     "repetition_penalty", "> 0"),
    ("presence_penalty 2.5", "chat/completions", {"messages": CONV, "presence_penalty": 2.5},
     400, "presence_penalty", "[-2.0, 2.0]"),
    ("frequency_penalty -3", "completions", {"prompt": "hi", "frequency_penalty": -3}, 400,
     "frequency_penalty", "[-2.0, 2.0]"),
    ("unknown model", "chat/completions", {"model": "gpt-4", "messages": CONV}, 404, "model",
     MODEL),
    ("too many stop strings", "completions", {"prompt": "hi", "stop": ["a"] * 17}, 400, "stop",
     "16"),
    ("stop string too long", "completions", {"prompt": "hi", "stop": "x" * 257}, 400, "stop",
     "256"),
    ("n 0", "completions", {"prompt": "hi", "n": 0}, 400, "n", ">= 1"),
    ("json_schema without a schema", "chat/completions", {
        "messages": CONV, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format.json_schema.schema", "JSON schema object"),
    ("json_schema of a type that does not exist", "chat/completions", {
        "messages": CONV, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "bogus"}}}}, 400,
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ("vLLM structured_outputs bad regex", "completions", {
        "prompt": "hi", "structured_outputs": {"regex": "a+("}}, 400,
     "structured_outputs.regex", "not a valid regex"),
    ("no messages", "chat/completions", {"messages": []}, 400, "messages", "1 message"),
    ("unknown role", "chat/completions", {"messages": [{"role": "x", "content": "hi"}]}, 400,
     "messages[0].role", "user"),
    ("top_logprobs 21", "chat/completions", {"messages": CONV, "logprobs": True,
                                             "top_logprobs": 21}, 400, "top_logprobs", "20"),
    ("body not an object", "completions", ["hi"], 400, "body", "object"),
    ("continuous_usage_stats not a boolean", "chat/completions", {
        "messages": CONV, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     400, "stream_options.continuous_usage_stats", "boolean"),
]


@pytest.mark.parametrize(("case", "path", "body", "status", "param", "bound"), BAD_BODIES,
                         ids=[c[0] for c in BAD_BODIES])
def test_bad_input_is_http_400(gateway, case, path, body, status, param, bound):
    resp = httpx.post(f"{gateway.http_url}/v1/{path}", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split("[")[0] in err["message"] and bound in err["message"]


@pytest.mark.parametrize("content", [b'{"prompt": "hi",', b'{"prompt": "\xff\xfe"}',
                                     b"x" * (5 << 20)], ids=["truncated", "utf8", "oversized"])
def test_malformed_body_is_http_400(gateway, client, content):
    resp = httpx.post(f"{gateway.http_url}/v1/completions", content=content, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"
    # still serving, through the official client too
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage


def test_client_disconnect_mid_stream_frees_everything(gateway):
    body = {"prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gateway.http_url}/v1/completions", json=body,
                      timeout=60) as resp:
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 3:
                    break
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    gateway.wait_idle()


def test_non_streamed_client_disconnect_frees_everything(gateway):
    body = {"prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{gateway.http_url}/v1/completions", json=body, timeout=1.5)
    gateway.wait_idle()
