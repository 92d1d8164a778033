"""Conditional prefill end to end: one `pdserve up --prefill-policy auto` stack (1 prefill + 1
decode worker over shm, the defaults a user gets) and extra gateways over the same workers for
the other policies. A short follow-up whose history the decode worker caches is prefilled by
the decode worker itself, with no KV moved and greedy output equal to the offline engine that
kept its replies too (conftest.py ref_chats); the
decision shows in the timing, /internal/status and pdserve:prefill_decisions_total; the
overrides force either side; a local prefill cut short (client gone, Abort) frees every
block."""

from __future__ import annotations

import time

import pytest

from engine_core.kv_cache.block_hash import hash_full_blocks
from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.extra_gateway import ExtraGateway
from tests.e2e.stack import (
    BLOCK_SIZE,
    CONV,
    LONG,
    N,
    Stack,
    check_timing,
    greedy,
    metric,
    out_ids,
    out_text,
    run,
)
from tests.helpers import log_tail, spawn_pdserve, wait_until

pytestmark = pytest.mark.slow

REFRESH_WAIT_S = 2.5  # the gateway rereads the workers' Status every second


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    start, stop = stack_factory
    s = start("--transport", "shm", "--prefill-policy", "auto")
    yield s
    stop(s)


def chat(conv: list[dict[str, str]], max_tokens: int = N) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in conv]),
                              sampling=greedy(max_tokens))


def transfers(stack: Stack) -> float:
    """KV transfers the prefill worker has committed (its own metrics)."""
    return metric(stack.metrics[1], "pdserve:kv_transfer_time_seconds_count")


def test_short_follow_up_whose_history_the_decode_worker_caches_is_prefilled_there(stack,
                                                                                   ref_chats):
    # turn 1: nothing measured yet, so the prefill pool takes it (and measures its speed)
    first = run(stack.generation(), chat(CONV))
    expected = ref_chats.chat(CONV, N)
    assert out_ids(first) == expected.outputs[0].token_ids
    first_ids = expected.prompt_token_ids
    t1 = first[-1].timing
    assert (t1.prefill_where, t1.prefill_reason) == ("remote", "unmeasured")
    check_timing(t1)
    time.sleep(REFRESH_WAIT_S)  # the gateway reads the measured speeds from Status
    # turn 2: the history (turn 1's prompt and reply) is cached on the decode worker
    conv = [*CONV, {"role": "assistant", "content": out_text(first)},
            {"role": "user", "content": "And of Germany?"}]
    num_transfers = transfers(stack)
    second = run(stack.generation(), chat(conv))
    expected = ref_chats.chat(conv, N)
    assert out_ids(second) == expected.outputs[0].token_ids
    assert out_text(second) == expected.outputs[0].text
    t2 = second[-1].timing
    assert (t2.prefill_where, t2.prefill_reason) == ("local", "cheaper_local")
    check_timing(t2)
    cached = second[-1].usage.cached_prompt_tokens  # the decode worker's prefix hit
    assert cached >= 16 and cached == expected.num_cached_tokens
    assert transfers(stack) == num_transfers  # no KV moved for it
    # the decision is counted and shown
    gw = stack.gateway_status()["prefill_placement"]
    assert gw["policy"] == "auto" and gw["last"]["where"] == "local"
    assert gw["last"]["local_cost_s"] < gw["last"]["remote_cost_s"]
    # the remote side was priced by what the prefill worker lists in its Status: turn 1's
    # prompt blocks, not the reply the decode worker computed
    n_first, n_second = len(first_ids), len(expected.prompt_token_ids)
    assert (gw["last"]["num_local_tokens"], gw["last"]["num_remote_tokens"]) == (
        n_second - cached, n_second - n_first // BLOCK_SIZE * BLOCK_SIZE)
    prefill_status = stack.status_all()[stack.prefill[0]]
    assert set(hash_full_blocks(first_ids, BLOCK_SIZE)) <= set(
        prefill_status.prefix_block_hashes)
    counts = {(d["where"], d["reason"]): d["count"] for d in gw["decisions"]}
    assert counts[("local", "cheaper_local")] >= 1 and counts[("remote", "unmeasured")] >= 1
    url = f"{stack.http_url}/metrics"
    assert metric(url, "pdserve:prefill_decisions_total",
                  'reason="cheaper_local",where="local"') >= 1
    decode = next(w for w in stack.gateway_status()["workers"] if w["role"] == "decode")
    assert decode["prefill_tokens_per_s"] > 0  # it measured its own prefill


def test_auto_keeps_a_prompt_over_the_local_bound_remote_and_always_remote_forces_it(stack,
                                                                                     ref):
    expected = ref.generate(LONG, N)
    bounded = ExtraGateway(stack, "--prefill-policy", "auto", "--local-prefill-max-tokens", "8")
    try:
        msgs = run(bounded.stub, pb.GenerateRequest(text=LONG, sampling=greedy(N)))
        assert out_ids(msgs) == expected.outputs[0].token_ids
        t = msgs[-1].timing
        assert (t.prefill_where, t.prefill_reason) == ("remote", "max_local_tokens")
    finally:
        bounded.stop()
    remote = ExtraGateway(stack, "--prefill-policy", "always-remote")
    try:
        num_transfers = transfers(stack)
        msgs = run(remote.stub, chat(CONV, 4))
        t = msgs[-1].timing
        assert (t.prefill_where, t.prefill_reason) == ("remote", "policy")
        assert transfers(stack) == num_transfers + 1
    finally:
        remote.stop()


def test_always_local_prefills_a_cold_prompt_on_the_decode_worker_and_frees_on_cancel(stack,
                                                                                     ref):
    local = ExtraGateway(stack, "--prefill-policy", "always-local")
    try:
        prompt = LONG + " then"  # not cached anywhere yet
        expected = ref.generate(prompt, N)
        num_transfers = transfers(stack)
        msgs = run(local.stub, pb.GenerateRequest(text=prompt, sampling=greedy(N)))
        assert out_ids(msgs) == expected.outputs[0].token_ids
        t = msgs[-1].timing
        assert (t.prefill_where, t.prefill_reason) == ("local", "policy")
        check_timing(t)
        assert transfers(stack) == num_transfers
        # a client that goes away mid-stream: the stream ends, its blocks go back (the
        # module's autouse check waits for both pools to be full again)
        call = local.stub.Generate(pb.GenerateRequest(
            text="Count to one thousand:", sampling=greedy(500, ignore_eos=True)), timeout=60)
        next(call)
        call.cancel()
        stack.wait_idle()
        # aborted by request id while its decode worker prefills or decodes it
        call = local.stub.Generate(pb.GenerateRequest(
            text=LONG * 6, request_id="local-aborted", sampling=greedy(500, ignore_eos=True)),
            timeout=60)
        decode = stack.decode_stub(stack.decode[0])
        wait_until(lambda: decode.Status(wpb.StatusRequest(), timeout=10).num_running == 1,
                   10, "the local prefill running", interval_s=0.002)
        assert local.stub.Abort(pb.AbortRequest(request_id="local-aborted"), timeout=10).found
        assert list(call)[-1].finish_reason == pb.FINISH_REASON_ABORT
        stack.wait_idle()
    finally:
        local.stop()


def test_bad_policy_flags_are_refused_naming_the_flag(stack):
    proc, log = spawn_pdserve("gateway", "--prefill", *stack.prefill, "--decode",
                              *stack.decode, "--port", "0", "--http-port", "0",
                              "--local-prefill-max-tokens", "-1", name="gateway-bad")
    assert proc.wait(60) != 0
    assert "local_prefill_max_tokens must be >= 0, got -1" in log_tail(log)
    proc, log = spawn_pdserve("gateway", "--prefill", *stack.prefill, "--decode",
                              *stack.decode, "--prefill-policy", "sometimes", name="gateway-bad")
    assert proc.wait(60) != 0
    assert "--prefill-policy: invalid choice: 'sometimes'" in log_tail(log)
