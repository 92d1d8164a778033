"""OpenAI API parity through the disaggregated stack (`pdserve up --transport shm`, 1 prefill +
1 decode): logit_bias and structured outputs reach the prefill worker, which samples the first
token, and the decode worker, which samples the rest. Through HTTP (the official `openai`
client) and gRPC."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import StructuredOutput
from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import check_timing, counter, greedy, out_ids, out_text, run
from tests.helpers import torch_threads
from tests.structured_schemas import ASK, MAX_TOKENS, SCHEMAS, TOOL_SCHEMAS, TOOLS, prompt_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smol"  # a second --served-model-name
PROMPT = "The capital of France is"
FORCED = 1000
N = 6


@pytest.fixture(scope="module")
def stack(stack_factory):
    start, stop = stack_factory
    s = start("--transport", "shm", "--served-model-name", MODEL, ALIAS)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as c:
        yield c


def test_served_model_names_reach_the_gateway(stack, client, ref):
    """`pdserve up --served-model-name MODEL smol`: both listed and accepted, the first in
    responses; any other name is refused naming both."""
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    listed = stack.generation().ListModels(pb.ListModelsRequest()).models
    assert [m.id for m in listed] == [MODEL, ALIAS]
    resp = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4, temperature=0)
    assert resp.model == MODEL
    assert resp.choices[0].text == ref.generate(PROMPT, 4).outputs[0].text
    with pytest.raises(openai.NotFoundError, match="'smol'"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    stack.wait_idle()


def test_the_responses_api_through_both_pools(stack, client):
    """The CPU defaults (bf16, int8 decode activations) behind /v1/responses: the same greedy
    output as the chat completion of the same conversation, whole and streamed."""
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N,
                                          temperature=0)
    resp = client.responses.create(model=MODEL, input=messages, max_output_tokens=N,
                                   temperature=0)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(model=MODEL, input=messages, max_output_tokens=N,
                                          temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == resp.output_text
    assert events[-1].response.status == resp.status
    stack.wait_idle()


def test_logit_bias_forces_a_token_on_both_workers(stack, client, ref):
    """Every token, the first (prefill worker) and the rest (decode worker), is FORCED."""
    msgs = run(stack.generation(), pb.GenerateRequest(
        text=PROMPT, sampling=greedy(N, logit_bias={FORCED: 100.0})))
    assert out_ids(msgs) == [FORCED] * N
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=1.0,
                                     seed=3, logit_bias={str(FORCED): 100})
    assert resp.choices[0].text == ref.tokenizer.decode([FORCED] * N)


def test_logit_bias_ban_matches_offline_engine(stack, client, ref):
    first = ref.generate(PROMPT, N).outputs[0].token_ids[0]
    params = SamplingParams(max_tokens=N, temperature=0.0, logit_bias={first: -100})
    with torch_threads(1):
        expected = ref.offline.llm.generate(PROMPT, params)[0].outputs[0]
    assert first not in expected.token_ids
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                     logit_bias={str(first): -100})
    assert resp.choices[0].text == expected.text


def test_bad_logit_bias_is_refused_and_the_stack_keeps_serving(stack, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  logit_bias={"49152": 5})
    assert e.value.body["param"] == "logit_bias" and "[0, 49152)" in e.value.body["message"]
    with pytest.raises(grpc.RpcError) as e:
        run(stack.generation(), pb.GenerateRequest(
            text=PROMPT, sampling=greedy(2, logit_bias={7: -100.5})))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in e.value.details()
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage


LONG = ("Once upon a time, in a small village at the edge of a dark forest, there lived an old "
        "clockmaker who had never once left the valley where he was born. Every morning he")


def prompt_counters(stack) -> tuple[float, float, float]:
    """(prefill decisions at the gateway, prompt tokens computed on both workers, forks)."""
    gateway, prefill, decode = stack.metrics
    return (counter(gateway, "prefill_decisions"),
            counter(prefill, "engine_prompt_tokens") + counter(decode, "engine_prompt_tokens"),
            counter(decode, "engine_forks"))


def test_n_and_batched_prompts_through_both_pools(stack, client, ref):
    """Greedy choices equal the offline engine; each prompt is placed, prefilled and handed
    off once, and its other samples fork from it on the decode worker."""
    prompts = [PROMPT + " a city that", LONG + " wound"]  # cached by no earlier test
    refs = [ref.generate(p, N) for p in prompts]
    before = prompt_counters(stack)
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=N,
                                     temperature=0, n=3)
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [refs[0].outputs[0].text] * 3 + \
        [refs[1].outputs[0].text] * 3
    assert resp.usage.completion_tokens == 6 * N
    stack.wait_idle()
    decisions, prompt_tokens, forks = (a - b for a, b in zip(prompt_counters(stack), before,
                                                              strict=True))
    # one placement (and prefill) per prompt; each child computes only its first token's
    # logits (the prompt's last token) over the shared KV
    assert (decisions, forks) == (2, 4)
    assert prompt_tokens == sum(len(r.prompt_token_ids) for r in refs) + 4
    seeded = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=N,
        temperature=1.0, seed=11, n=2, stream=True)
    texts: dict[int, str] = {}
    for chunk in seeded:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    alone = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=N,
        temperature=1.0, seed=12)
    assert texts[1] == alone.choices[0].message.content


def test_grpc_n_through_both_pools(stack, ref):
    out = ref.generate(LONG, N)
    expected = out.outputs[0].token_ids
    msgs = run(stack.generation(), pb.GenerateRequest(text=LONG, sampling=greedy(N), n=3))
    samples: dict[int, list[int]] = {}
    for m in msgs:
        samples.setdefault(m.index, []).extend(m.token_ids)
    assert samples == {i: list(expected) for i in range(3)}
    last = [m for m in msgs if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(m.index for m in last) == [0, 1, 2]
    num_prompt = len(out.prompt_token_ids)
    assert sorted(m.usage.cached_prompt_tokens for m in last)[1:] == [num_prompt - 1] * 2
    for m in last:
        check_timing(m.timing)
    assert {m.timing.prefill_where for m in last} - {"remote", "local"} == {"fork"}
    # Abort(request_id) ends every sample, forks included, and frees every block
    stream = stack.generation().Generate(pb.GenerateRequest(
        request_id="n-abort", text=LONG, n=3, sampling=greedy(400, ignore_eos=True)),
        timeout=120)
    first = next(stream)
    assert stack.generation().Abort(pb.AbortRequest(request_id="n-abort"), timeout=30).found
    finished = [m for m in [first, *stream] if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(m.index for m in finished) == [0, 1, 2]
    assert {m.finish_reason for m in finished} == {pb.FINISH_REASON_ABORT}
    stack.wait_idle()


def test_lm_eval_loglikelihood_prompt_logprobs_from_the_prefill_worker(stack, client, ref):
    """lm-evaluation-harness's request as sent; the prompt logprobs come from the prefill
    worker and equal the offline engine's, also when the prompt is cached on both workers."""
    tok = ref.tokenizer
    ctx = tok.encode("Question: What is the capital of France?\nAnswer:")
    batch = [ctx + tok.encode(c, add_special_tokens=False) for c in (" Paris", " Rome")]
    with torch_threads(1):
        refs = [ref.offline.llm.generate(ids, SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=1))[0] for ids in batch]
    for _ in range(2):  # the second time the prompts are in both workers' prefix caches
        resp = client.completions.create(model=MODEL, prompt=batch, max_tokens=1, logprobs=1,
                                         echo=True, temperature=0, seed=1234)
        for ids, r, choice in zip(batch, refs, resp.choices, strict=True):
            lps = choice.logprobs.token_logprobs
            assert lps[0] is None and len(lps) == len(ids) + 1
            for p in range(1, len(ids)):
                assert abs(lps[p] - r.prompt_logprobs[p][ids[p]]) < 2e-2  # bf16 workers
    msgs = run(stack.generation(), pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=batch[0]), sampling=greedy(2, prompt_logprobs=0)))
    plp = msgs[0].prompt_logprobs
    assert [e.token_id for e in plp] == batch[0][1:]
    assert all(not m.prompt_logprobs for m in msgs[1:])


@pytest.fixture(scope="module")
def local_stack(stack_factory, stack):  # after the module's other stack is up
    start, stop = stack_factory
    s = start("--transport", "shm", "--prefill-policy", "always-local")
    yield s
    stop(s)


def test_prompt_logprobs_prefill_remotely_under_always_local(local_stack, ref):
    """A decode worker never computes prompt logprobs: such a request goes to the prefill
    worker whatever the placement policy, and its logprobs equal the offline engine's."""
    ids = ref.tokenizer.encode(PROMPT)
    plain = run(local_stack.generation(), pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=greedy(2)))
    assert plain[-1].timing.prefill_where == "local"
    msgs = run(local_stack.generation(), pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=greedy(2, prompt_logprobs=0)))
    t = msgs[-1].timing
    assert (t.prefill_where, t.prefill_reason) == ("remote", "prompt_logprobs")
    with torch_threads(1):
        want = ref.offline.llm.generate(ids, SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=0))[0].prompt_logprobs
    got = msgs[0].prompt_logprobs
    assert [e.token_id for e in got] == ids[1:]
    assert all(abs(e.logprob - want[p][ids[p]]) < 2e-2 for p, e in enumerate(got, start=1))
    local_stack.wait_idle()


STRUCTURED = ["person", "nested_address", "array_of_objects", "matrix", "one_of_shapes",
              "refs", "product", "top_level_array"]


def test_structured_outputs_through_both_pools(stack, client, ref):
    """The prefill worker samples the first token under the grammar; the decode worker replays
    it into its own matcher and constrains the rest: greedy outputs equal the offline engine's
    and sampled ones validate, on both endpoints and over gRPC."""
    def chat(args):
        name, temperature = args
        resp = client.chat.completions.create(
            model=MODEL, messages=prompt_for(name, SCHEMAS[name]), max_tokens=MAX_TOKENS,
            temperature=temperature, response_format={"type": "json_schema", "json_schema": {
                "name": name, "schema": SCHEMAS[name]}})
        return name, temperature, resp.choices[0]

    jobs = [(name, t) for name in STRUCTURED for t in (0.0, 1.0)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(chat, jobs))
    greedy_names = STRUCTURED[:2]
    with torch_threads(1):
        refs = ref.offline.llm.generate(
            [ref.tokenizer.apply_chat_template(prompt_for(n, SCHEMAS[n])) for n in greedy_names],
            [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=StructuredOutput(
                "json", json.dumps(SCHEMAS[n]))) for n in greedy_names])
    expected = dict(zip(greedy_names, (r.outputs[0].text for r in refs), strict=True))
    for name, temperature, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
        if temperature == 0.0 and name in expected:
            assert choice.message.content == expected[name]
    resp = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20,
                                     temperature=1.0,
                                     extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", resp.choices[0].text)
    msgs = run(stack.generation(), pb.GenerateRequest(text="Pick:", sampling=greedy(
        10, structured=pb.StructuredOutput(choice=pb.Choices(values=["north-east",
                                                                     "south-west"])))))
    assert out_text(msgs) in ("north-east", "south-west")
    assert msgs[-1].timing.prefill_where == "remote"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={
                                           "structured_outputs": {"regex": "(bad"}})
    assert e.value.body["param"] == "structured_outputs.regex"


def test_tool_calls_through_both_pools(stack, client):
    """`required` and a named tool_choice are enforced across the handoff (the first token
    of the call on the prefill worker, the rest on the decode worker), streamed and not."""
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          max_tokens=200, temperature=1.0,
                                          tool_choice="required", seed=3)
    assert resp.choices[0].finish_reason == "tool_calls"
    for call in resp.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    # deltas: the call's name first, then its arguments as they are generated
    assert finish == "tool_calls" and {d.index for d in deltas} == {0} and len(deltas) > 2
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS["get_weather"])
