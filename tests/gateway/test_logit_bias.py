"""logit_bias through a real colocated gateway: +100 forces a token and -100 bans it, greedy
and sampled, over HTTP (the official `openai` client) and gRPC; bad values are a 400 /
INVALID_ARGUMENT naming the field, and the gateway keeps serving."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import openai
import pytest

from engine_core.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
FORCED = 1000  # an ordinary BPE token, never the greedy choice after PROMPT
N = 6


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=f"{gateway.http_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as c:
        yield c


def test_plus_100_forces_a_token_greedy_and_sampled(client, gateway, offline):
    forced_text = offline.tokenizer.decode([FORCED] * N)
    for temperature in (0.0, 1.0):
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N,
                                         temperature=temperature, seed=7,
                                         logit_bias={str(FORCED): 100})
        assert resp.choices[0].text == forced_text
        assert resp.usage.completion_tokens == N
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=N,
        temperature=0.8, logit_bias={str(FORCED): 100})
    assert chat.choices[0].message.content == forced_text
    gateway.wait_idle()


def test_minus_100_bans_the_greedy_token(client, gateway, offline):
    ref = offline.generate(PROMPT, N)
    first = ref.outputs[0].token_ids[0]
    params = SamplingParams(max_tokens=N, temperature=0.0, logit_bias={first: -100})
    expected = offline.llm.generate(PROMPT, params)[0].outputs[0]
    assert expected.token_ids[0] != first and first not in expected.token_ids
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                     logit_bias={str(first): -100})
    assert resp.choices[0].text == expected.text
    # sampled at a high temperature: the banned token never appears
    for seed in range(3):
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N,
                                         temperature=1.5, seed=seed, logprobs=0,
                                         logit_bias={str(first): -100})
        assert offline.tokenizer.decode([first]) not in resp.choices[0].logprobs.tokens
    gateway.wait_idle()


def test_grpc_logit_bias_forces_and_validates(gateway):
    with gateway.channel() as channel:
        stub = gateway.stub(channel)
        req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParameters(
            max_tokens=N, temperature=0.0, logit_bias={FORCED: 100.0}))
        ids = [t for m in stub.Generate(req, timeout=120) for t in m.token_ids]
        assert ids == [FORCED] * N
        for bias, bound in (({49152: 1.0}, "[0, 49152)"), ({5: 150.0}, "[-100, 100]")):
            bad = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParameters(
                max_tokens=2, logit_bias=bias))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(bad, timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "logit_bias" in e.value.details() and bound in e.value.details()
    gateway.wait_idle()


BAD = [  # (case, logit_bias, bound named in the message)
    ("bias above 100", {"5": 100.5}, "[-100, 100]"),
    ("bias below -100", {"5": -101}, "[-100, 100]"),
    ("id outside the vocabulary", {"49152": 1}, "[0, 49152)"),
    ("negative id", {"-3": 1}, ">= 0"),
    ("key not a token id", {"hello": 1}, "token ids"),
    ("bias not a number", {"5": "high"}, "numbers"),
    ("not an object", [5, 1], "object"),
]


@pytest.mark.parametrize(("case", "bias", "bound"), BAD, ids=[c[0] for c in BAD])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_bad_logit_bias_is_http_400(gateway, client, case, bias, bound, path):
    body = {"logit_bias": bias, "max_tokens": 2}
    body |= {"prompt": PROMPT} if path == "completions" else {
        "messages": [{"role": "user", "content": "Hi"}]}
    resp = httpx.post(f"{gateway.http_url}/v1/{path}", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "logit_bias" and "logit_bias" in err["message"], err
    assert bound in err["message"], err
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage
