"""Generated requests (hypothesis) thrown at the real gateway's gRPC API: every answer is
either a complete result (a finish reason, usage that adds up) or a clean INVALID_ARGUMENT
naming a field, never another status, a hang or a crash; afterwards the engine is idle with
every KV block free and the gateway still serves a normal request."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.pdserve.v1 import generate_pb2 as pb

VOCAB = 49152
FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs")

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.floats(-3, 3), st.sampled_from([0.0, 1.0, -1.0]))
small_ints = st.one_of(st.integers(-3, 6), st.sampled_from([2**31 - 1, -(2**31), 100_000]))
sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": small_ints, "min_tokens": small_ints, "temperature": numbers,
    "top_p": numbers, "top_k": st.integers(-3, 60), "min_p": numbers,
    "repetition_penalty": numbers, "presence_penalty": numbers, "frequency_penalty": numbers,
    "seed": st.integers(-(2**63), 2**63 - 1), "logprobs": st.integers(-2, 25),
    "stop": st.lists(st.text(max_size=8), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 5), max_size=3),
    "ignore_eos": st.booleans(),
})
prompts = st.one_of(
    st.text(max_size=40).map(lambda t: {"text": t}),
    st.lists(st.integers(0, VOCAB + 2), max_size=12).map(
        lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool", ""]),
                       st.text(max_size=20)), max_size=3).map(
        lambda msgs: {"chat": pb.ChatMessages(messages=[
            pb.ChatMessage(role=r, content=c) for r, c in msgs])}),
)


def bounded(params: dict) -> dict:
    """Keep accepted requests short: a huge max_tokens that would pass validation is cut to
    8 (the test is about answers, not long generations); invalid values stay invalid."""
    out = dict(params)
    mt = out.get("max_tokens")
    if mt is not None and 8 < mt <= 8192:
        out["max_tokens"] = 8
    if "max_tokens" not in out:
        out["max_tokens"] = 4
    return out


@pytest.fixture(scope="module")
def stub(gateway):
    with gateway.channel() as channel:
        yield gateway.stub(channel)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(prompt=prompts, params=sampling)
def test_every_answer_is_a_result_or_a_clean_error(stub, prompt, params):
    req = pb.GenerateRequest(**prompt, sampling=pb.SamplingParameters(**bounded(params)))
    try:
        msgs = list(stub.Generate(req, timeout=120))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), req)
        field = dict(e.trailing_metadata() or ()).get("pdserve-invalid-field")
        assert field and e.details(), req
        return
    last = msgs[-1]
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
    n_out = sum(len(m.token_ids) for m in msgs)
    assert last.usage.completion_tokens == n_out <= req.sampling.max_tokens
    assert last.usage.prompt_tokens >= 1
    for key in ("temperature", "top_p"):  # an accepted request had sane numbers
        if req.sampling.HasField(key):
            assert math.isfinite(getattr(req.sampling, key))


def test_after_the_storm_the_gateway_is_idle_and_serves(gateway, stub):
    gateway.wait_idle()
    msgs = list(stub.Generate(pb.GenerateRequest(
        text="Hello", sampling=pb.SamplingParameters(max_tokens=3, temperature=0)), timeout=60))
    assert msgs[-1].usage.completion_tokens == 3
    gateway.wait_idle()
