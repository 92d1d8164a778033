"""End to end through one `pdserve up --transport shm` stack (1 prefill + 1 decode worker and the
gateway, separate processes, on the defaults a user gets): exact greedy output against the
offline engine on the same defaults, a decode prefix-cache hit, streaming over gRPC and the
official `openai` client with the timing breakdown, and cancellation and deadlines (both pools
back to full). The stack (conftest.py shm_stack) is shared with test_e2e_shm_reservations.py."""

from __future__ import annotations

import grpc
import openai
import pytest

from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    CONV,
    LONG,
    MODEL,
    PROMPTS,
    N,
    check_greedy_chat,
    check_greedy_text,
    check_repeat_hits_decode_cache,
    check_timing,
    counter,
    greedy,
    out_ids,
    out_text,
    run,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

ENDLESS = greedy(2000, ignore_eos=True)  # a stream long enough to be cut in the middle
# (500 tokens once finished inside the 3 s deadline below, on a fast hour)


@pytest.fixture(scope="module")
def stack(shm_stack):
    return shm_stack


@pytest.fixture(scope="module")
def stub(stack):
    return stack.generation()


# -- 1. exact greedy output ------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_offline_engine(stack, ref, name):
    check_greedy_text(stack, ref, PROMPTS[name])


def test_chat_matches_offline_engine(stack, ref):
    check_greedy_chat(stack, ref)


def test_repeat_hits_decode_prefix_cache_and_matches(stack, ref):
    check_repeat_hits_decode_cache(stack, ref, "shm")


# -- 2. streaming and the timing breakdown ----------------------------------------------------
def test_grpc_stream_logprobs_usage_timing(stub, ref):
    expected = ref.generate(PROMPTS["short"], N)
    assert expected.outputs[0].finish_reason == "length"
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=expected.prompt_token_ids),
                             request_id="e2e-stream-1", sampling=greedy(N, logprobs=2))
    msgs = run(stub, req)
    assert len(msgs) > 2 and all(m.request_id == "e2e-stream-1" for m in msgs)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert out_ids(msgs) == expected.outputs[0].token_ids
    assert out_text(msgs) == expected.outputs[0].text
    # the first token's logprobs come from the prefill worker, the rest from the decode worker
    lps = [e for m in msgs for e in m.logprobs]
    assert [e.token_id for e in lps] == out_ids(msgs)
    assert all(len(e.top) == 2 and e.top[0].token_id == e.token_id and e.logprob <= 0
               for e in lps)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(expected.prompt_token_ids), N)
    assert all(not m.HasField("timing") for m in msgs[:-1]) and last.HasField("timing")
    check_timing(last.timing)
    assert last.timing.first_decode_step_s > 0


def test_openai_chat_stream_with_timing(stack, ref):
    expected = ref.chat(CONV, N).outputs[0]
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=CONV, max_tokens=N, temperature=0, stream=True,
            stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) > 2  # really streamed
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == expected.text
    finals = [c.choices[0].finish_reason for c in with_choices]
    assert finals[-1] == expected.finish_reason and set(finals[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    check_timing(with_choices[-1].model_extra["timing"])  # pdserve's extra field


def test_openai_stream_closed_mid_way_frees_both_pools(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", timeout=120,
                       max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=CONV, max_tokens=500, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 4:
                break
        stream.close()
    assert all(c.choices[0].finish_reason is None for c in chunks)
    stack.wait_idle()


# -- 3. cancellation and deadlines free both pools ---------------------------------------------
def test_client_cancel_mid_stream_frees_both_pools(stack, stub):
    call = stub.Generate(pb.GenerateRequest(text="Count to a thousand:", sampling=ENDLESS),
                         timeout=120)
    got = [next(call), next(call)]
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in got)
    # mid-stream: the decode worker holds the sequence
    assert stack.status_all()[stack.decode[0]].num_running == 1
    call.cancel()
    stack.wait_idle()
    assert run(stub, pb.GenerateRequest(text="hi", sampling=greedy(2)))[-1].finish_reason


def test_client_cancel_during_handoff_frees_both_pools(stack, stub):
    """Cancelled while the decode worker holds the reservation (the prompt is being prefilled
    and its KV shipped): the prefill worker aborts, the lease ends, the blocks come back."""
    call = stub.Generate(pb.GenerateRequest(text=LONG * 4, sampling=ENDLESS), timeout=120)
    decode = stack.decode_stub(stack.decode[0])
    wait_until(lambda: decode.Status(wpb.StatusRequest(), timeout=10).num_reserved == 1, 10,
               "the reservation", interval_s=0.002)
    call.cancel()
    stack.wait_idle()
    assert run(stub, pb.GenerateRequest(text="hi", sampling=greedy(2)))[-1].finish_reason


def test_abort_during_handoff_spares_the_next_request(stack, stub, ref):
    """Abort (by request id) a request whose KV is being handed off while a second request
    waits for the same prefill worker: the first ends with finish reason abort, the second
    still completes exactly (one request's ended lease must not break the prefill worker's
    connection to the decode worker)."""
    first = stub.Generate(pb.GenerateRequest(text=LONG * 4, request_id="handoff-aborted",
                                             sampling=ENDLESS), timeout=120)
    second = stub.Generate(pb.GenerateRequest(text=PROMPTS["code"], request_id="handoff-next",
                                              sampling=greedy(N)), timeout=120)
    decode = stack.decode_stub(stack.decode[0])
    wait_until(lambda: decode.Status(wpb.StatusRequest(), timeout=10).num_reserved == 2, 10,
               "both reservations", interval_s=0.002)
    assert stub.Abort(pb.AbortRequest(request_id="handoff-aborted"), timeout=10).found
    assert list(first)[-1].finish_reason == pb.FINISH_REASON_ABORT
    msgs = list(second)
    expected = ref.generate(PROMPTS["code"], N).outputs[0]
    assert out_ids(msgs) == expected.token_ids and out_text(msgs) == expected.text


def test_deadline_during_reserve_frees_the_decode_pool(stack, stub):
    """While the decode worker steps a running sequence, a Reserve waits for the step in
    progress (~0.1 s here); deadlines that pass then must not leave a reservation behind,
    neither in the decode worker's engine nor under a lease the gateway never heard of (which
    the lease ttl would free: no lease may end EXPIRED)."""
    decode_metrics = stack.metrics[2]
    expired = counter(decode_metrics, "kv_leases_ended", state="EXPIRED")
    busy = stub.Generate(pb.GenerateRequest(text="Count to a thousand:", sampling=ENDLESS),
                         timeout=120)
    next(busy)
    for timeout_s in (0.01, 0.02, 0.03, 0.04, 0.05) * 2:
        with pytest.raises(grpc.RpcError) as info:
            run(stub, pb.GenerateRequest(text=LONG, sampling=greedy(4)), timeout=timeout_s)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    busy.cancel()
    stack.wait_idle()
    assert counter(decode_metrics, "kv_leases_ended", state="EXPIRED") == expired


@pytest.mark.parametrize(("prompt", "timeout_s", "mid_stream"), [
    ("Count to a thousand:", 3.0, True),  # the deadline passes while decoding
    (LONG * 4, 0.3, False),  # ... while reserving, prefilling or handing off the KV
], ids=["mid-decode", "during-prefill"])
def test_deadline_exceeded_frees_both_pools(stack, stub, prompt, timeout_s, mid_stream):
    call = stub.Generate(pb.GenerateRequest(text=prompt, sampling=ENDLESS), timeout=timeout_s)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in call:
            got.append(msg)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    if mid_stream:
        assert got, "no token before the deadline"
    stack.wait_idle()
    msgs = run(stub, pb.GenerateRequest(text="hi", sampling=greedy(2)))
    assert msgs[-1].usage.completion_tokens == 2
