"""`n` > 1 and batched prompts through a real colocated gateway: one choice per (prompt,
sample) at index prompt * n + sample, greedy choices equal to the offline engine, seeded
sample i equal to a lone request seeded seed + i, streams interleaved by index, the samples
of a prompt forked from its one prefill, the bound on n x prompts, and every block freed
(also when the client leaves mid-stream)."""

from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the engine's default
# > 2 full KV blocks and a partial one, which the samples share until they write into it
LONG = ("Once upon a time, in a small village at the edge of a dark forest, there lived an old "
        "clockmaker who had never once left the valley where he was born. Every morning he")
PROMPTS = ["The capital of France is", LONG]
N_TOKENS = 8


@pytest.fixture(scope="module")
def client(gateway):
    with openai.OpenAI(base_url=f"{gateway.http_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as c:
        yield c


def test_n_greedy_completions_fork_from_one_prefill(client, gateway, offline):
    prompt = LONG + " wound"  # cached by no earlier test
    ref = offline.generate(prompt, N_TOKENS)
    before = gateway.status()
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS,
                                     temperature=0, n=3)
    after = gateway.wait_idle()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [ref.outputs[0].text] * 3
    num_prompt = len(ref.prompt_token_ids)
    assert resp.usage.prompt_tokens == num_prompt  # the prompt counts once
    assert resp.usage.completion_tokens == 3 * N_TOKENS
    # the prompt is computed once; each child recomputes only its last token (its own first
    # token's logits) over the shared blocks, and counts the rest as cached
    assert after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"] == \
        num_prompt + 2
    assert after["num_forks"] - before["num_forks"] == 2
    # usage counts the prompt and its cache hits once (OpenAI's cached <= prompt tokens)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_n_seeded_sample_i_is_seed_plus_i(client, gateway):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=1.0)
    resp = client.completions.create(n=3, seed=100, **kw)
    alone = [client.completions.create(seed=100 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in resp.choices] == alone
    assert len(set(alone)) > 1  # the seeds differ, so (almost surely) do the samples
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
        temperature=1.0, seed=5, n=2)
    one = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
        temperature=1.0, seed=6)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[1].message.content == one.choices[0].message.content
    gateway.wait_idle()


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token_ids"])
def test_batched_prompts_with_n(client, gateway, offline, as_ids):
    refs = [offline.generate(p, N_TOKENS) for p in PROMPTS]
    prompt = [list(r.prompt_token_ids) for r in refs] if as_ids else PROMPTS
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS,
                                     temperature=0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [refs[0].outputs[0].text] * 2 + \
        [refs[1].outputs[0].text] * 2
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert resp.usage.completion_tokens == 4 * N_TOKENS
    gateway.wait_idle()


def test_streamed_choices_interleave_by_index(client, gateway, offline):
    refs = [offline.generate(p, N_TOKENS) for p in PROMPTS]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=N_TOKENS,
                                       temperature=0, n=2, stream=True,
                                       stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.append(c.index)
    assert sorted(finished) == [0, 1, 2, 3]
    assert texts == {0: refs[0].outputs[0].text, 1: refs[0].outputs[0].text,
                     2: refs[1].outputs[0].text, 3: refs[1].outputs[0].text}
    assert usage.completion_tokens == 4 * N_TOKENS
    gateway.wait_idle()


BAD = [  # (case, body, param, bound named in the message)
    ("n 0", {"prompt": "hi", "n": 0}, "n", ">= 1"),
    ("n not an int", {"prompt": "hi", "n": "2"}, "n", "integer"),
    ("n over the bound", {"prompt": "hi", "n": 65}, "n", "max_num_choices (64)"),
    ("n x prompts over the bound", {"prompt": ["a"] * 33, "n": 2}, "n", "33 = 66"),
    ("an empty prompt in a batch", {"prompt": ["hi", ""]}, "prompt[1]", "empty"),
    ("a bad token id in a batch", {"prompt": [[1, 2], [3, 49152]]}, "prompt[1][1]",
     "[0, 49152)"),
    ("a batch entry of the wrong type", {"prompt": ["hi", ["x"]]}, "prompt[1]", "token ids"),
]


@pytest.mark.parametrize(("case", "body", "param", "bound"), BAD, ids=[c[0] for c in BAD])
def test_bad_n_or_batch_is_http_400(gateway, client, case, body, param, bound):
    resp = httpx.post(f"{gateway.http_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and bound in err["message"], err
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage


def test_client_leaving_an_n_stream_frees_every_block(gateway):
    body = {"prompt": PROMPTS, "n": 3, "max_tokens": 300, "ignore_eos": True,
            "temperature": 1.0, "stream": True}
    with httpx.stream("POST", f"{gateway.http_url}/v1/completions", json=body,
                      timeout=60) as resp:
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 10:
                    break
    assert {c["index"] for e in events for c in e["choices"]} <= set(range(6))
    gateway.wait_idle()


def _by_index(msgs) -> dict[int, list]:
    out: dict[int, list] = {}
    for m in msgs:
        out.setdefault(m.index, []).append(m)
    return out


def test_grpc_n_samples_seeded_and_bounded(gateway):
    import grpc

    from protos.pdserve.v1 import generate_pb2 as pb

    def sampling(seed: int) -> pb.SamplingParameters:
        return pb.SamplingParameters(max_tokens=N_TOKENS, temperature=1.0, seed=seed)

    with gateway.channel() as channel:
        stub = gateway.stub(channel)
        msgs = list(stub.Generate(pb.GenerateRequest(
            request_id="grpc-n", text=LONG, sampling=sampling(40), n=3), timeout=120))
        assert {m.request_id for m in msgs} == {"grpc-n"}
        samples = _by_index(msgs)
        assert sorted(samples) == [0, 1, 2]
        for i, sample in samples.items():
            assert [m.finish_reason != pb.FINISH_REASON_UNSPECIFIED for m in sample][-1]
            alone = list(stub.Generate(pb.GenerateRequest(text=LONG, sampling=sampling(40 + i)),
                                       timeout=120))
            assert [t for m in sample for t in m.token_ids] == \
                [t for m in alone for t in m.token_ids]
        assert sum(s[-1].usage.cached_prompt_tokens for s in samples.values()) >= \
            2 * BLOCK_SIZE
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="hi", n=65), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_num_choices (64)" in e.value.details()
        # Abort(request_id) aborts every sample
        stream = stub.Generate(pb.GenerateRequest(
            request_id="grpc-n-abort", text=LONG, n=2, sampling=pb.SamplingParameters(
                max_tokens=400, ignore_eos=True)), timeout=120)
        first = next(stream)
        assert stub.Abort(pb.AbortRequest(request_id="grpc-n-abort"), timeout=30).found
        rest = [first, *stream]
        finished = [m for m in rest if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
        assert sorted(m.index for m in finished) == [0, 1]
        assert {m.finish_reason for m in finished} == {pb.FINISH_REASON_ABORT}
        assert sum(m.usage.completion_tokens for m in finished) < 100
    gateway.wait_idle()
