"""The public gRPC API of a real gateway process: exact greedy output, streaming, bad input,
cancellation and deadlines (the engine ends idle with every KV block free)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdserve.v1 import generate_pb2 as pb

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
CONV = [{"role": "user", "content": "What is the capital of France?"}]
N = 16  # tokens per greedy comparison (references are computed once, see conftest.py)
GENERATE = "/pdserve.v1.Generation/Generate"


def greedy(max_tokens: int, **kw) -> pb.SamplingParameters:
    return pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, **kw)


def run(stub, req: pb.GenerateRequest, **kw) -> list[pb.GenerateResponse]:
    return list(stub.Generate(req, **kw))


@pytest.fixture(scope="module")
def channel(gateway):
    with gateway.channel() as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(gateway, channel):
    return gateway.stub(channel)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_offline_engine(stub, offline, prompt):
    msgs = run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(N)))
    ref = offline.generate(prompt, N)
    assert [t for m in msgs for t in m.token_ids] == ref.outputs[0].token_ids
    assert "".join(m.text for m in msgs) == ref.outputs[0].text


def test_chat_matches_offline_engine(stub, offline):
    req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**CONV[0])]),
                             sampling=greedy(N))
    msgs = run(stub, req)
    ref = offline.chat(CONV, N)
    assert [t for m in msgs for t in m.token_ids] == ref.outputs[0].token_ids


def test_stream_deltas_usage_and_timing(gateway, stub, offline):
    ref = offline.generate(PROMPTS[0], N)
    assert ref.outputs[0].finish_reason == "length"  # so ignore_eos changes nothing
    ids = ref.prompt_token_ids
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), request_id="stream-1",
                             sampling=greedy(N, ignore_eos=True, logprobs=2))
    msgs = run(stub, req)
    assert len(msgs) > 1 and all(m.request_id == "stream-1" for m in msgs)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    out_ids = [t for m in msgs for t in m.token_ids]
    assert out_ids == ref.outputs[0].token_ids
    assert "".join(m.text for m in msgs) == ref.outputs[0].text == offline.tokenizer.decode(
        out_ids)
    # one logprob entry per token, the sampled token the most likely one (greedy)
    lps = [e for m in msgs for e in m.logprobs]
    assert [e.token_id for e in lps] == out_ids
    assert all(len(e.top) == 2 and e.top[0].token_id == e.token_id for e in lps)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), N)
    t = last.timing
    assert min(t.queue_s, t.prefill_s, t.first_decode_step_s) > 0 and t.kv_transfer_s == 0
    assert t.ttft_s == pytest.approx(t.queue_s + t.prefill_s, abs=1e-6)
    assert t.ttft_s + t.first_decode_step_s <= t.total_s
    assert t.total_s < 60


def test_list_models_health_and_reflection(gateway, stub, channel):
    models = stub.ListModels(pb.ListModelsRequest()).models
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].vocab_size == 49152 and models[0].max_model_len == 8192
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Generation"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(refl.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names


S = pb.SamplingParameters
BAD_REQUESTS = [  # (case, request, field in trailing metadata, bound named in the message)
    ("empty text", pb.GenerateRequest(text=""), "text", "empty"),
    ("no prompt", pb.GenerateRequest(), "prompt", "one of"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids", "1 token"),
    ("token id outside vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 49152])),
     "token_ids.ids[1]", "[0, 49152)"),
    ("prompt beyond context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 8192)),
     "token_ids", "8191"),
    ("prompt + max_tokens beyond context", pb.GenerateRequest(text="hi", sampling=S(
        max_tokens=8192)), "sampling.max_tokens", "8192"),
    ("max_tokens 0", pb.GenerateRequest(text="hi", sampling=S(max_tokens=0)),
     "sampling.max_tokens", ">= 1"),
    ("max_tokens negative", pb.GenerateRequest(text="hi", sampling=S(max_tokens=-3)),
     "sampling.max_tokens", ">= 1"),
    ("max_tokens absurd", pb.GenerateRequest(text="hi", sampling=S(max_tokens=2**31 - 1)),
     "sampling.max_tokens", "8192"),
    ("temperature < 0", pb.GenerateRequest(text="hi", sampling=S(temperature=-0.5)),
     "sampling.temperature", ">= 0"),
    ("temperature nan", pb.GenerateRequest(text="hi", sampling=S(temperature=float("nan"))),
     "sampling.temperature", "finite"),
    ("top_p 0", pb.GenerateRequest(text="hi", sampling=S(top_p=0.0)), "sampling.top_p",
     "(0, 1]"),
    ("top_p 1.5", pb.GenerateRequest(text="hi", sampling=S(top_p=1.5)), "sampling.top_p",
     "(0, 1]"),
    ("top_k -2", pb.GenerateRequest(text="hi", sampling=S(top_k=-2)), "sampling.top_k", "-1"),
    ("min_p 1.5", pb.GenerateRequest(text="hi", sampling=S(min_p=1.5)), "sampling.min_p",
     "[0, 1]"),
    ("repetition_penalty < 0", pb.GenerateRequest(text="hi", sampling=S(
        repetition_penalty=-1.0)), "sampling.repetition_penalty", "> 0"),
    ("presence_penalty 2.5", pb.GenerateRequest(text="hi", sampling=S(presence_penalty=2.5)),
     "sampling.presence_penalty", "[-2.0, 2.0]"),
    ("frequency_penalty -3", pb.GenerateRequest(text="hi", sampling=S(frequency_penalty=-3.0)),
     "sampling.frequency_penalty", "[-2.0, 2.0]"),
    ("unknown model", pb.GenerateRequest(text="hi", model="gpt-4"), "model",
     "SmolLM2-135M-Instruct"),
    ("too many stop strings", pb.GenerateRequest(text="hi", sampling=S(stop=["a"] * 17)),
     "sampling.stop", "16"),
    ("stop string too long", pb.GenerateRequest(text="hi", sampling=S(stop=["x" * 257])),
     "sampling.stop", "256"),
    ("stop token outside vocab", pb.GenerateRequest(text="hi", sampling=S(
        stop_token_ids=[10**6])), "sampling.stop_token_ids[0]", "49152"),
    ("logprobs 21", pb.GenerateRequest(text="hi", sampling=S(logprobs=21)),
     "sampling.logprobs", "20"),
    ("min_tokens > max_tokens", pb.GenerateRequest(text="hi", sampling=S(
        max_tokens=4, min_tokens=5)), "sampling.min_tokens", "max_tokens=4"),
    ("request id with a space", pb.GenerateRequest(text="hi", request_id="a b"),
     "request_id", "128"),
    ("empty chat", pb.GenerateRequest(chat=pb.ChatMessages()), "chat.messages", "1 message"),
    ("unknown chat role", pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="wizard", content="hi")])), "chat.messages[0].role", "user"),
    ("oversized request", pb.GenerateRequest(text="x" * (5 << 20)), "request", "4194304"),
]


@pytest.mark.parametrize(("case", "req", "field", "bound"), BAD_REQUESTS,
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_is_invalid_argument(stub, case, req, field, bound):
    with pytest.raises(grpc.RpcError) as info:
        run(stub, req)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert dict(err.trailing_metadata())["pdserve-invalid-field"] == field
    assert field.split(".")[-1].split("[")[0] in err.details() and bound in err.details()


@pytest.mark.parametrize(("raw", "field"), [
    (pb.GenerateRequest(text="AB").SerializeToString(), "text"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="ok"), pb.ChatMessage(role="user", content="AB")]))
     .SerializeToString(), "chat.messages[1].content"),
    (pb.GenerateRequest(text="hi", sampling=S(stop=["AB"])).SerializeToString(),
     "sampling.stop[0]"),
], ids=["text", "chat content", "stop string"])
def test_invalid_utf8_is_invalid_argument(channel, stub, raw, field):
    call = channel.unary_stream(GENERATE, request_serializer=None,
                                response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        list(call(raw.replace(b"AB", b"\xff\xfe")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == f"{field} must be valid UTF-8"
    # still serving
    assert run(stub, pb.GenerateRequest(text="hi", sampling=greedy(2)))[-1].usage.completion_tokens


def test_client_cancel_mid_stream_frees_everything(gateway, stub):
    call = stub.Generate(pb.GenerateRequest(text="Count to a thousand:",
                                            sampling=greedy(500, ignore_eos=True)))
    got = [next(call), next(call)]
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in got)
    call.cancel()
    gateway.wait_idle()


def test_deadline_exceeded_frees_everything(gateway, stub):
    req = pb.GenerateRequest(text="Count to a thousand:", sampling=greedy(500, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as info:
        run(stub, req, timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gateway.wait_idle()
    assert run(stub, pb.GenerateRequest(text="hi", sampling=greedy(2)))[-1].finish_reason


def test_abort_by_request_id(gateway, stub):
    call = stub.Generate(pb.GenerateRequest(text="Count:", request_id="to-abort",
                                            sampling=greedy(500, ignore_eos=True)))
    next(call)
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    rest = list(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and rest[-1].timing.total_s > 0
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    gateway.wait_idle()


def test_generate_cli_prints_text(gateway, offline):
    prompt = PROMPTS[0]
    ref = offline.generate(prompt, N)
    for stream in ([], ["--stream"]):
        out = subprocess.run(
            [sys.executable, "-m", "pdserve", "generate", prompt, "--max-tokens", str(N),
             "--gateway", gateway.grpc_addr, *stream],
            capture_output=True, text=True, timeout=60, check=True).stdout
        assert out == ref.outputs[0].text + "\n"
