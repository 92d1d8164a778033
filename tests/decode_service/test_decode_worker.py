"""DecodeWorker over a fake engine (no model, milliseconds): a reservation whose KV is verified
is admitted with the first token computed elsewhere and streams from it; a lease that ends
before the claim aborts the reserved request."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_service.server import accepted_transports
from decode_service.worker import DecodeWorker, LeaseNotReady
from engine_core.kv_cache.block_hash import hash_full_blocks
from engine_core.outputs import RequestDelta
from engine_core.sampling_params import SamplingParams
from kv_transfer import LeaseTable
from tests.service_infra.fake_engine import FakeEngine

BLOCK_SIZE = 16


class FakeDecodeEngine(FakeEngine):
    """FakeEngine plus the two decode verbs: reserve blocks, admit with a first token."""

    def __init__(self) -> None:
        super().__init__()
        self.layout = type("Layout", (), {"block_size": BLOCK_SIZE})()
        self.num_kv_blocks = 64
        self.reserved: dict[str, SamplingParams] = {}

    def reserve(self, prompt, params, req_id, num_prior_output_tokens=0):
        self.reserved[req_id] = params
        return list(range(-(-len(prompt) // BLOCK_SIZE))), 0

    def admit_prefilled(self, req_id, first_token, first_logprobs=None):
        params = self.reserved.pop(req_id)  # KeyError: nothing reserved under this id
        metrics = {"first_scheduled": 0.0, "first_token": 0.0}
        if params.max_tokens <= 1:  # the first token is its last
            return RequestDelta(req_id, [first_token], "", 1, finish_reason="length",
                                is_first=True, metrics={**metrics, "finished": 0.0})
        self.add_request([1, 2, 3], params, req_id)
        self.scheduler.requests[req_id][2].append(first_token)
        return RequestDelta(req_id, [first_token], "", 1, is_first=True, metrics=metrics)

    def abort_request(self, req_ids):
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            if self.reserved.pop(req_id, None) is not None:
                self.aborted.append(req_id)
        super().abort_request(req_ids)


def run(body):
    async def main():
        engine = FakeDecodeEngine()
        holder: dict[str, DecodeWorker] = {}
        table = LeaseTable(on_release=lambda lease, why: holder["w"].on_lease_released(lease,
                                                                                      why))
        worker = holder["w"] = DecodeWorker(engine, table)
        try:
            return await body(worker, table, engine)
        finally:
            await worker.close()

    return asyncio.run(main())


def deliver(table: LeaseTable, lease_id: str, block_ids: list[int]) -> None:
    """What a prefill worker's transfer does to the lease, short of moving bytes."""
    table.begin(lease_id, block_ids, "grpc", is_one_sided=False)
    table.start_verify(lease_id)
    table.complete(lease_id, ok=True)


def test_verified_kv_is_claimed_and_streams_from_the_first_token():
    async def body(worker, table, engine):
        res = await worker.reserve("r", [1, 2, 3], SamplingParams(max_tokens=3), ttl_s=5.0)
        deliver(table, res.lease_id, res.block_ids)
        chunks = [c async for c in worker.decode("r", 7, None, ready_timeout_s=1.0)]
        return chunks, worker.reservations, table.leases()

    chunks, reservations, leases = run(body)
    assert [t for c in chunks for t in c.token_ids] == [7, 2, 3]
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 3
    assert reservations == {} and leases == []  # claimed: the engine owns the blocks now


@pytest.mark.parametrize("keeps_replies", [True, False])
def test_a_finished_reply_is_recorded_for_routing_where_the_engine_keeps_it(keeps_replies):
    prompt = list(range(100, 114))  # 14 tokens: no full block of its own

    async def body(worker, table, engine):
        engine.kv.cache_decoded_blocks = keeps_replies
        res = await worker.reserve("r", prompt, SamplingParams(max_tokens=4), ttl_s=5.0)
        deliver(table, res.lease_id, res.block_ids)
        chunks = [c async for c in worker.decode("r", 7, None, ready_timeout_s=1.0)]
        return [t for c in chunks for t in c.token_ids], worker.prefix.hashes()

    output, recorded = run(body)
    assert len(output) == 4
    # every token but the last has its KV computed: 14 + 3 tokens hold one full block
    expected = hash_full_blocks(prompt + output[:-1], BLOCK_SIZE) if keeps_replies else []
    assert len(expected) == (1 if keeps_replies else 0)
    assert sorted(recorded) == sorted(expected)


def test_a_lease_aborted_before_the_claim_aborts_the_reserved_request():
    async def body(worker, table, engine):
        await worker.reserve("r", [1, 2, 3], SamplingParams(max_tokens=3), ttl_s=5.0)
        assert await worker.abort_anywhere("r", "client gone")
        with pytest.raises(LeaseNotReady):
            [c async for c in worker.decode("r", 7, None, ready_timeout_s=0.1)]
        await worker.status()  # runs in the engine thread after the abort
        return engine.aborted

    assert run(body) == ["r"]


@pytest.mark.parametrize(("flag", "device", "want"), [
    ("auto", "cpu", ["grpc", "shm"]),
    ("auto", "cuda", ["grpc", "cuda_ipc"]),
    ("grpc", "cuda", ["grpc"]),
    ("grpc, cuda_ipc", "cuda", ["grpc", "cuda_ipc"]),
    ("grpc,shm", "cpu", ["grpc", "shm"]),
])
def test_accepted_transports_follow_the_engine_device(flag, device, want):
    assert accepted_transports(flag, torch.device(device)) == want


@pytest.mark.parametrize(("flag", "device", "match"), [
    ("grpc,shm", "cuda", "shm is a host-memory pool"),
    ("cuda_ipc", "cpu", "cuda_ipc needs a KV cache on CUDA"),
    ("grpc,bogus", "cpu", "unknown transport 'bogus'"),
])
def test_accepted_transports_refuse_what_cannot_work(flag, device, match):
    with pytest.raises(SystemExit, match=match):
        accepted_transports(flag, torch.device(device))
