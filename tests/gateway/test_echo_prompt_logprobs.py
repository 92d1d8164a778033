"""echo with logprobs and vLLM's prompt_logprobs on /v1/completions of a real colocated
gateway: lm-evaluation-harness's loglikelihood request as it sends it (token-id prompts in a
batch, max_tokens 1, logprobs 1, echo true) gets the prompt tokens' logprobs the offline
engine computes, also when the prompt is in the prefix cache; streamed and non-streamed."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from engine_core.sampling_params import SamplingParams

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATIONS = [" Paris", " London"]


@pytest.fixture(scope="module")
def batch(offline) -> list[list[int]]:
    ctx = offline.tokenizer.encode(CONTEXT)
    return [ctx + offline.tokenizer.encode(c, add_special_tokens=False) for c in CONTINUATIONS]


def expected(offline, ids: list[int], n: int):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=n, logprobs=n)
    return offline.llm.generate(ids, params)[0]


def test_lm_eval_loglikelihood_request(gateway, offline, batch):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": batch, "max_tokens": 1,
            "temperature": 0, "logprobs": 1, "seed": 1234, "echo": True}
    for _ in range(2):  # the second finds the prompts in the prefix cache: recomputed
        resp = httpx.post(f"{gateway.http_url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choices = resp.json()["choices"]
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert [c["index"] for c in choices] == [0, 1]
        for ids, choice in zip(batch, choices, strict=True):
            ref = expected(offline, ids, 1)
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the generated token
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for p in range(1, len(ids)):
                assert lp["token_logprobs"][p] == pytest.approx(
                    ref.prompt_logprobs[p][ids[p]], abs=1e-4)
                assert len(lp["top_logprobs"][p]) == 1
            assert choice["text"].startswith(offline.tokenizer.decode(ids))
            # what lm-eval computes: sum over the continuation, and is it greedy
            ctxlen = len(ids) - 1
            got = sum(lp["token_logprobs"][ctxlen:-1])
            assert got == pytest.approx(ref.prompt_logprobs[-1][ids[-1]], abs=1e-4)
    gateway.wait_idle()


def test_prompt_logprobs_vllm_shape_and_stream(gateway, offline, batch):
    ids = batch[0]
    ref = expected(offline, ids, 2)
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(f"{gateway.http_url}/v1/completions", json=body,
                        timeout=120).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        assert set(plp[p]) == {str(t) for t in ref.prompt_logprobs[p]}
        assert plp[p][str(ids[p])]["logprob"] == pytest.approx(
            ref.prompt_logprobs[p][ids[p]], abs=1e-4)
    assert choice["logprobs"] is None and not choice["text"].startswith(CONTEXT)
    with httpx.stream("POST", f"{gateway.http_url}/v1/completions", timeout=120, json={
            **body, "stream": True, "echo": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["prompt_logprobs"][1][str(ids[1])]["logprob"] == pytest.approx(
        plp[1][str(ids[1])]["logprob"], abs=1e-6)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == offline.tokenizer.decode(ids) + choice["text"]
    gateway.wait_idle()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
])
def test_bad_prompt_logprobs_is_http_400(gateway, body, param):
    resp = httpx.post(f"{gateway.http_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    chat = httpx.post(f"{gateway.http_url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"


def test_grpc_prompt_logprobs_in_the_first_message(gateway, offline, batch):
    import grpc

    from protos.pdserve.v1 import generate_pb2 as pb

    ids = batch[1]
    ref = expected(offline, ids, 2)
    with gateway.channel() as channel:
        stub = gateway.stub(channel)
        msgs = list(stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParameters(
                max_tokens=3, temperature=0, prompt_logprobs=2)), timeout=120))
        plp = msgs[0].prompt_logprobs
        assert [e.token_id for e in plp] == ids[1:]
        for p, e in enumerate(plp, start=1):
            assert e.logprob == pytest.approx(ref.prompt_logprobs[p][ids[p]], abs=1e-4)
            assert {t.token_id for t in e.top} == set(ref.prompt_logprobs[p])
        assert all(not m.prompt_logprobs for m in msgs[1:])
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(
                prompt_logprobs=21)), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_logprobs" in err.value.details()
    gateway.wait_idle()
