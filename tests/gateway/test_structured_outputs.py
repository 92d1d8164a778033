"""Structured outputs through a real colocated gateway with the official `openai` client:
response_format (json_schema, json_object) and vLLM's structured_outputs (json, regex, choice,
grammar) on both endpoints, streamed and not, n > 1, a cut output reported as `length`, the
gRPC field; bad specs are a 400 / INVALID_ARGUMENT naming the field, and the gateway keeps
serving."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from tests.structured_schemas import MAX_TOKENS, SCHEMAS, prompt_for

MODEL = "SmolLM2-135M-Instruct"
SOME = ["person", "nested_address", "array_of_objects", "one_of_shapes", "refs", "product"]


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=f"{gateway.http_url}/v1", api_key="unused", timeout=180,
                       max_retries=0) as c:
        yield c


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def test_json_schema_on_both_endpoints_greedy_and_sampled(client, gateway):
    def chat(args):
        name, temperature = args
        resp = client.chat.completions.create(
            model=MODEL, messages=prompt_for(name, SCHEMAS[name]), max_tokens=MAX_TOKENS,
            temperature=temperature, response_format=_schema_format(name))
        return name, resp.choices[0]

    def completion(args):
        name, temperature = args
        resp = client.completions.create(
            model=MODEL, prompt=f"A {name.replace('_', ' ')} as JSON:", max_tokens=MAX_TOKENS,
            temperature=temperature, extra_body={"structured_outputs": {"json": SCHEMAS[name]}})
        return name, resp.choices[0]

    jobs = [(f, (name, t)) for name in SOME for t in (0.0, 1.0) for f in (chat, completion)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one batch in the engine
        results = list(pool.map(lambda job: job[0](job[1]), jobs))
    for name, choice in results:
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    gateway.wait_idle()


def test_streamed_n2_and_json_object(client, gateway):
    stream = client.chat.completions.create(
        model=MODEL, messages=prompt_for("person", SCHEMAS["person"]), max_tokens=MAX_TOKENS,
        temperature=1.0, n=2, stream=True, response_format=_schema_format("person"))
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["person"])
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object, please."}],
        max_tokens=48, temperature=0.0, response_format={"type": "json_object"})
    choice = resp.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    gateway.wait_idle()


def test_regex_choice_grammar_and_the_cut_output(client, gateway):
    cases = [({"regex": "[A-Z]{2}-[0-9]{3}"}, r"[A-Z]{2}-[0-9]{3}"),
             ({"choice": ["alpha", "beta", "gamma"]}, r"alpha|beta|gamma"),
             ({"grammar": 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'}, r"x=[0-9]{1,3};")]
    for options, pattern in cases:
        for temperature in (0.0, 1.0):
            resp = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20,
                                             temperature=temperature,
                                             extra_body={"structured_outputs": options})
            assert re.fullmatch(pattern, resp.choices[0].text), (options, resp.choices[0].text)
    legacy = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5,
                                       extra_body={"guided_choice": ["up", "down"]})
    assert legacy.choices[0].text in ("up", "down")
    cut = client.chat.completions.create(
        model=MODEL, messages=prompt_for("product", SCHEMAS["product"]), max_tokens=3,
        temperature=0.0, response_format=_schema_format("product"))
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 3
    gateway.wait_idle()


def test_grpc_structured_field(gateway):
    schema = SCHEMAS["enum_color"]
    with gateway.channel() as channel:
        stub = gateway.stub(channel)
        req = pb.GenerateRequest(text="Color:", sampling=pb.SamplingParameters(
            max_tokens=30, temperature=1.0,
            structured=pb.StructuredOutput(json_schema=json.dumps(schema))))
        msgs = list(stub.Generate(req, timeout=120))
        jsonschema.validate(json.loads("".join(m.text for m in msgs)), schema)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        choice = pb.GenerateRequest(text="Pick:", sampling=pb.SamplingParameters(
            max_tokens=5, structured=pb.StructuredOutput(choice=pb.Choices(values=["on",
                                                                                   "off"]))))
        assert "".join(m.text for m in stub.Generate(choice, timeout=60)) in ("on", "off")
        for bad in (pb.StructuredOutput(regex="(unclosed"),
                    pb.StructuredOutput(json_schema="{not json"),
                    pb.StructuredOutput(grammar="start: missing_rule"),
                    pb.StructuredOutput(choice=pb.Choices()),
                    pb.StructuredOutput(regex="a", after_tokens=range(17)),  # at most 16
                    pb.StructuredOutput(regex="a", after_tokens=[5, 10**7])):  # the vocabulary
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(
                    max_tokens=2, structured=bad)), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "sampling.structured" in e.value.details(), e.value.details()
    gateway.wait_idle()


BAD = [  # (case, body fields, field named)
    ("unknown response_format type", {"response_format": {"type": "xml"}}, "response_format"),
    ("json_schema without schema", {"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("schema not an object", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
    ("schema with a bad type", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "banana"}}}}, "response_format.json_schema.schema"),
    ("bad regex", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ("empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("bad grammar", {"structured_outputs": {"grammar": "start: nothing_here"}},
     "structured_outputs.grammar"),
    ("json not JSON", {"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ("two constraints", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("structured_outputs not an object", {"structured_outputs": "json"}, "structured_outputs"),
    ("response_format and structured_outputs", {
        "response_format": {"type": "json_object"},
        "structured_outputs": {"regex": "a"}}, "structured_outputs"),
]


@pytest.mark.parametrize(("case", "fields", "param"), BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_bad_structured_output_is_http_400(gateway, client, case, fields, param, path):
    body = {"model": MODEL, "max_tokens": 2, **fields}
    body |= {"prompt": "Hi"} if path == "completions" else {
        "messages": [{"role": "user", "content": "Hi"}]}
    resp = httpx.post(f"{gateway.http_url}/v1/{path}", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage
