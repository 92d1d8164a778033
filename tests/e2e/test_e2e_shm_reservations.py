"""The decode worker's reservations, end to end through the `pdserve up --transport shm` stack
that test_e2e_shm.py also uses (conftest.py shm_stack): the gateway renews the leases of
prompts queued for prefill, and a transfer's deadline stands; while the decode pool is full,
requests wait at the gateway within bounds; a KV layout mismatch is refused at handshake by a
decode worker of another dtype, and its reservation is released."""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    BLOCK_SIZE,
    LEASE_TTL_S,
    LONG,
    MAX_QUEUE_WAIT_S,
    MAX_WAITING,
    OTHER_DTYPE,
    PROMPTS,
    STACK_DTYPE,
    STARTUP_TIMEOUT_S,
    N,
    Stack,
    greedy,
    is_idle,
    out_ids,
    run,
)
from tests.helpers import wait_for_output, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(shm_stack):
    return shm_stack


@pytest.fixture(scope="module")
def stub(stack):
    return stack.generation()


# -- 1. leases of queued prompts are renewed; a transfer's deadline stands --------------------
def test_burst_queued_longer_than_the_lease_ttl_completes(stack, stub, ref):
    """48 prompts at once into one prefill worker: the last ones wait in its queue for over a
    lease ttl while their decode blocks stay reserved (the gateway renews the leases); every
    request completes with the offline engine's greedy output and both pools end full."""
    # ~110 tokens each, distinct first blocks: 5.3k tokens to prefill on one core, and 7 KV
    # blocks each, so that all 48 fit the decode worker's pool (0.25 GB: 364 blocks) at once.
    # On the fastest hour seen, 32 of them queued 2.25 s at most: the pool's size bounds the
    # queue, so the ttl is short (stack.py) rather than the burst long.
    prompts = [f"Note {i}: {LONG * 2}" for i in range(48)]

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


# -- 2. a full decode pool: requests wait at the gateway, within bounds -------------------------
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


# -- 3. a KV layout mismatch is refused at handshake ---------------------------------------------
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
