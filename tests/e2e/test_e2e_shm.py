"""End to end through one `pdserve up --transport shm` stack (1 prefill + 1 decode worker and the
gateway, separate processes, on the defaults a user gets): exact greedy output against the
offline engine on the same defaults, a decode prefix-cache hit, streaming over gRPC and the
official `openai` client with the timing breakdown, cancellation and deadlines (both pools back
to full), and a KV layout mismatch refused at handshake by a decode worker of another dtype."""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import torch

from engine_core.config import dtype_name, resolve_dtype
from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    BLOCK_SIZE,
    CONV,
    LONG,
    MODEL,
    PROMPTS,
    STARTUP_TIMEOUT_S,
    N,
    Stack,
    check_greedy_chat,
    check_greedy_text,
    check_repeat_hits_decode_cache,
    check_timing,
    greedy,
    is_idle,
    out_ids,
    out_text,
    run,
)
from tests.helpers import (
    kill_tree,
    log_tail,
    spawn_pdserve,
    stop_process,
    wait_for_output,
    wait_until,
)

pytestmark = pytest.mark.slow

ENDLESS = greedy(500, ignore_eos=True)  # a stream long enough to be cut in the middle
# the gateway's lease ttl: short, so that prompts queued for prefill outlive it (renewed)
LEASE_TTL_S = 3.0
# the gateway's admission bounds while the decode pool is full
MAX_WAITING = 4
MAX_QUEUE_WAIT_S = 10.0


# the stack's KV dtype (what dtype "auto" resolves to here) and another one
STACK_DTYPE = dtype_name(resolve_dtype(None, torch.device("cpu")))
OTHER_DTYPE = "float32" if STACK_DTYPE == "bfloat16" else "bfloat16"


@pytest.fixture(scope="module")
def other_decode():
    """A lone decode worker whose KV cache has OTHER_DTYPE, a layout that differs from the
    stack's: (process, log). It loads alongside the stack; the test waits for its READY line."""
    proc, log = spawn_pdserve("decode", "--dtype", OTHER_DTYPE, "--port", "0",
                              "--kv-cache-memory-gb", "0.05", name="decode-other-dtype")
    try:
        yield proc, log
        assert stop_process(proc, 30) == 0, log_tail(log)
        assert "Traceback" not in log.read_text(), log_tail(log)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def stack(stack_factory, other_decode):  # the other worker loads alongside the stack
    start, stop = stack_factory
    s = start("--transport", "shm", "--lease-ttl", str(LEASE_TTL_S), "--max-waiting",
              str(MAX_WAITING), "--max-queue-wait", str(MAX_QUEUE_WAIT_S))
    assert (len(s.prefill), len(s.decode)) == (1, 1)
    yield s
    stop(s)


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
    neither in the decode worker's engine nor under a lease the gateway never heard of."""
    busy = stub.Generate(pb.GenerateRequest(text="Count to a thousand:", sampling=ENDLESS),
                         timeout=120)
    next(busy)
    for timeout_s in (0.01, 0.02, 0.03, 0.04, 0.05) * 2:
        with pytest.raises(grpc.RpcError) as info:
            run(stub, pb.GenerateRequest(text=LONG, sampling=greedy(4)), timeout=timeout_s)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    busy.cancel()
    stack.wait_idle()  # within IDLE_TIMEOUT_S: less than the gateway's 30 s lease TTL


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


# -- 5. leases of queued prompts are renewed; a transfer's deadline stands --------------------
def test_burst_queued_longer_than_the_lease_ttl_completes(stack, stub, ref):
    """32 prompts at once into one prefill worker: the last ones wait in its queue for several
    lease ttls while their decode blocks stay reserved (the gateway renews the leases); every
    request completes with the offline engine's greedy output and both pools end full."""
    # ~110 tokens each, distinct first blocks: 3.5k tokens to prefill on one core, and 7 KV
    # blocks each, so that all 32 fit the decode worker's pool (0.25 GB: 364 blocks) at once
    prompts = [f"Note {i}: {LONG * 2}" for i in range(32)]

    def one(prompt: str) -> list[pb.GenerateResponse]:
        return run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(4)), timeout=300)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    queue_s = [msgs[-1].timing.queue_s for msgs in results]
    assert max(queue_s) > LEASE_TTL_S, f"the burst did not queue long enough: {queue_s}"
    for i in (0, len(prompts) - 1):  # the first and the (probably) longest-queued one
        assert out_ids(results[i]) == ref.generate(prompts[i], 4).outputs[0].token_ids
    assert all(m[-1].usage.completion_tokens == 4 for m in results)
    stack.wait_idle()


def test_renew_lease_rpc(stack, ref):
    """Decode.RenewLease keeps a RESERVED lease past its ttl; the prefill that then arrives
    gets the full ttl for its transfer; renewing a claimed or a stranger's lease is NOT_FOUND,
    a ttl out of bounds INVALID_ARGUMENT naming lease_ttl_s."""
    decode, prefill = stack.decode_stub(stack.decode[0]), stack.prefill_stub(stack.prefill[0])
    ids = ref.tokenizer.encode(PROMPTS["code"])
    rid = f"renew-{uuid.uuid4().hex}"
    res = decode.Reserve(wpb.ReserveRequest(request_id=rid, prompt_token_ids=ids,
                                            sampling=greedy(N), lease_ttl_s=1.0), timeout=10)
    renew = wpb.RenewLeaseRequest(request_id=rid, lease_id=res.lease_id, lease_ttl_s=1.0)
    for _ in range(6):  # 1.8 s: the 1 s lease outlived
        time.sleep(0.3)
        assert 0.5 < decode.RenewLease(renew, timeout=10).remaining_s <= 1.0
    with pytest.raises(grpc.RpcError) as info:
        decode.RenewLease(wpb.RenewLeaseRequest(request_id="someone-else", lease_id=res.lease_id,
                                                lease_ttl_s=1.0), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    for ttl in (0.0, 1e6):
        with pytest.raises(grpc.RpcError) as info:
            decode.RenewLease(wpb.RenewLeaseRequest(request_id=rid, lease_id=res.lease_id,
                                                    lease_ttl_s=ttl), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lease_ttl_s" in info.value.details()
    first = prefill.Prefill(wpb.PrefillRequest(
        request_id=rid, prompt_token_ids=ids, sampling=greedy(N),
        target=wpb.KVTarget(transfer_address=res.transfer_address, lease_id=res.lease_id,
                            dst_block_ids=res.block_ids, first_block=0, transport="shm")),
        timeout=60)
    got = [t for m in decode.Decode(wpb.DecodeRequest(
        request_id=rid, first_token_id=first.first_token_id), timeout=60) for t in m.token_ids]
    assert got == ref.generate(PROMPTS["code"], N).outputs[0].token_ids
    with pytest.raises(grpc.RpcError) as info:
        decode.RenewLease(renew, timeout=10)  # claimed by the decode: nothing left to renew
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()


# -- 6. a full decode pool: requests wait at the gateway, within bounds -------------------------
def _fill_decode_pool(stack: Stack, ref, ids_per_block: int) -> list[str]:
    """Reserve all but 2 free blocks of the decode worker (prompts whose KV never comes, each
    within the model's length): the reservations' request ids."""
    decode = stack.decode_stub(stack.decode[0])
    # a prompt leaves room for its one token
    max_blocks = ref.offline.llm.engine.max_model_len // BLOCK_SIZE - 1
    left = decode.Status(wpb.StatusRequest(), timeout=10).num_free_blocks - 2
    rids = []
    while left > 0:
        n = min(left, max_blocks)
        rids.append(f"filler-{uuid.uuid4().hex}")
        decode.Reserve(wpb.ReserveRequest(
            request_id=rids[-1], prompt_token_ids=[ids_per_block + len(rids)] * n * BLOCK_SIZE,
            sampling=greedy(1), lease_ttl_s=120), timeout=10)
        left -= n
    return rids


def _abort_all(stack: Stack, rids: list[str], reason: str) -> None:
    decode = stack.decode_stub(stack.decode[0])
    for rid in rids:
        decode.Abort(wpb.AbortRequestRequest(request_id=rid, reason=reason), timeout=10)


def test_full_decode_pool_requests_wait_then_complete(stack, stub, ref):
    """While the decode pool is full, requests wait at the gateway (up to max_waiting of them;
    one more gets RESOURCE_EXHAUSTED naming the bound) and complete with the offline greedy
    output once room frees; a deadline passes while waiting -> DEADLINE_EXCEEDED; no room
    within max_queue_wait -> RESOURCE_EXHAUSTED naming it. Both pools end full."""
    filler = _fill_decode_pool(stack, ref, 42)
    prompt = PROMPTS["long"]  # 4 blocks + output: more than the 2 left
    with ThreadPoolExecutor(MAX_WAITING) as pool:
        waiting = [pool.submit(run, stub, pb.GenerateRequest(text=prompt, sampling=greedy(N)))
                   for _ in range(MAX_WAITING)]
        wait_until(lambda: stack.gateway_status()["num_admission_waiting"] == MAX_WAITING, 30,
                   "requests waiting for decode room")
        with pytest.raises(grpc.RpcError) as info:
            run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(N)), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "max_waiting" in info.value.details()
        assert not any(f.done() for f in waiting)
        _abort_all(stack, filler, "room")
        expected = ref.generate(prompt, N).outputs[0].token_ids
        assert [out_ids(f.result(timeout=120)) for f in waiting] == [expected] * MAX_WAITING
    filler = _fill_decode_pool(stack, ref, 43)
    try:
        with pytest.raises(grpc.RpcError) as info:
            run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(N)), timeout=1.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(N)), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "max_queue_wait_s" in info.value.details()
        assert time.monotonic() - t0 >= MAX_QUEUE_WAIT_S
        assert stack.gateway_status()["num_admission_waiting"] == 0
    finally:
        _abort_all(stack, filler, "done")


# -- 7. a KV layout mismatch is refused at handshake ---------------------------------------------
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_layout_mismatch_refused_at_handshake(stack, other_decode, ref, transport):
    """The stack's prefill worker is asked to ship KV into the reservation of a decode worker
    with another KV dtype: FAILED_PRECONDITION naming the dtype field; the decode worker's
    reservation is released (by its lease's expiry when nobody aborts it, at once on
    Decode.Abort)."""
    proc, log = other_decode
    address = wait_for_output(proc, log, re.compile(r"READY decode (\S+)"), STARTUP_TIMEOUT_S,
                              "the other-dtype decode worker")[1]
    decode = stack.decode_stub(address)
    prefill = stack.prefill_stub(stack.prefill[0])
    ids = ref.tokenizer.encode(LONG)

    def attempt(ttl_s: float) -> tuple[str, grpc.RpcError]:
        rid = f"mismatch-{uuid.uuid4().hex}"
        res = decode.Reserve(wpb.ReserveRequest(request_id=rid, prompt_token_ids=ids,
                                                sampling=greedy(N), lease_ttl_s=ttl_s),
                             timeout=10)
        assert decode.Status(wpb.StatusRequest(), timeout=10).num_reserved == 1
        with pytest.raises(grpc.RpcError) as info:
            prefill.Prefill(wpb.PrefillRequest(
                request_id=rid, prompt_token_ids=ids, sampling=greedy(N),
                target=wpb.KVTarget(transfer_address=res.transfer_address,
                                    lease_id=res.lease_id, dst_block_ids=res.block_ids,
                                    first_block=0, transport=transport)), timeout=30)
        return rid, info.value

    def released():
        return is_idle(decode.Status(wpb.StatusRequest(), timeout=10))

    # nobody aborts: the lease expires and frees the blocks
    _, err = attempt(ttl_s=1.0)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    details = err.details()
    assert "layout mismatch" in details, details
    assert f"dtype: '{STACK_DTYPE}' != '{OTHER_DTYPE}'" in details, details
    wait_until(released, 15, "the expired lease to free the other worker's blocks")
    # what the gateway does after a failed prefill: Decode.Abort frees them at once
    rid, err = attempt(ttl_s=60.0)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "dtype" in err.details()
    assert decode.Abort(wpb.AbortRequestRequest(request_id=rid, reason="test"), timeout=10).found
    wait_until(released, 5, "Decode.Abort to free the other worker's blocks")
    # the stack's prefill worker is unharmed
    assert is_idle(stack.status_all()[stack.prefill[0]])
