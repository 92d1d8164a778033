"""A prefill worker whose queue is full answers RESOURCE_EXHAUSTED (prefill_service/service.py):
the gateway asks the next prefill worker, and refuses the request (Overloaded, HTTP 429) only
when every one is full. Real gRPC servers on loopback stand in for the prefill workers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_core.sampling_params import SamplingParams
from gateway.disagg.backend import DisaggregatedBackend
from gateway.disagg.discovery import StaticDiscovery
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra.backend import GenerateInput, Overloaded
from service_infra.proto_convert import sampling_to_proto


class QueuePrefill(pb_grpc.PrefillServicer):
    """Answers Prefill with first token 42, or RESOURCE_EXHAUSTED when `full`."""

    def __init__(self, full: bool) -> None:
        self.full = full
        self.calls: list[str] = []

    async def Prefill(self, request, context):
        self.calls.append(request.request_id)
        if self.full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "1 requests already wait for their first token on this "
                                "engine (max_waiting 1)")
        return pb.PrefillResponse(first_token_id=42, transport="shm")


async def _serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _prefill_with(full: list[bool], in_flight: tuple[int, ...] = ()
                  ) -> tuple[list[QueuePrefill], object]:
    """The gateway's prefill stage of one request over workers whose queues are `full` (and
    that have `in_flight` requests from this gateway: routing's first choice is the least
    busy); returns the servicers and the reply or the Overloaded error."""
    servicers = [QueuePrefill(f) for f in full]

    async def scenario():
        servers = [await _serve(s) for s in servicers]
        backend = DisaggregatedBackend(StaticDiscovery([a for _, a in servers],
                                                       ["127.0.0.1:1"]), tokenizer=None)
        try:
            await backend.pools.discover()
            for i, w in enumerate(backend.prefill):
                w.is_healthy = True
                w.in_flight = in_flight[i] if in_flight else 0
            inp = GenerateInput("r1", list(range(40)), SamplingParams(max_tokens=4))
            reservation = pb.ReserveResponse(lease_id="l1", block_ids=[1, 2, 3],
                                             transfer_address="127.0.0.1:1")
            try:
                return await backend.handoff.prefill(inp, sampling_to_proto(inp.params),
                                              backend.decode[0], reservation)
            except Overloaded as e:
                return e
        finally:
            await backend.close()
            for server, _ in servers:
                await server.stop(None)

    return servicers, asyncio.run(scenario())


def test_a_full_prefill_queue_sends_the_request_to_the_next_worker():
    servicers, reply = _prefill_with([True, False], in_flight=(0, 1))  # the full one first
    assert isinstance(reply, pb.PrefillResponse) and reply.first_token_id == 42
    assert [s.calls for s in servicers] == [["r1"], ["r1"]]  # refused there, prefilled here


@pytest.mark.parametrize("num_workers", [1, 2])
def test_when_every_prefill_queue_is_full_the_request_is_refused(num_workers):
    servicers, reply = _prefill_with([True] * num_workers)
    assert isinstance(reply, Overloaded), reply
    assert f"every prefill worker is full ({num_workers} refused" in str(reply)
    assert [s.calls for s in servicers] == [["r1"]] * num_workers  # each asked once
