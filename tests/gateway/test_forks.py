"""The disaggregated backend's forks (gateway/disagg/forks.py) against fake workers on loopback: the
samples of a prompt reserve and prefill once and fork on the parent's decode worker; a fork
aborted while it waits for its parent never reaches a worker; the in-flight counts return to
zero."""

from __future__ import annotations

import asyncio

import grpc

from engine_core.sampling_params import SamplingParams
from gateway.disagg.backend import DisaggregatedBackend
from gateway.disagg.discovery import StaticDiscovery
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra.backend import GenerateInput
from service_infra.proto_convert import FINISH_REASONS

PROMPT = list(range(40))


class FakePrefill(pb_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def Prefill(self, request, context):
        self.calls.append(request.request_id)
        return pb.PrefillResponse(first_token_id=42, transport="shm", compute_s=0.01)


class FakeDecode(pb_grpc.DecodeServicer):
    """Reserve waits for `release`; Decode and Fork stream one token and finish."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: list[tuple[str, str]] = []

    async def Reserve(self, request, context):
        self.calls.append(("Reserve", request.request_id))
        await self.release.wait()
        return pb.ReserveResponse(lease_id="l", block_ids=[1, 2, 3],
                                  transfer_address="127.0.0.1:1")

    async def Decode(self, request, context):
        self.calls.append(("Decode", request.request_id))
        yield pb.DecodeResponse(token_ids=[request.first_token_id],
                                finish_reason=FINISH_REASONS["length"])

    async def Fork(self, request, context):
        self.calls.append(("Fork", f"{request.request_id}<{request.parent_request_id}"))
        yield pb.DecodeResponse(token_ids=[7], finish_reason=FINISH_REASONS["length"],
                                prefill_s=0.001)

    async def Abort(self, request, context):
        self.calls.append(("Abort", request.request_id))
        return pb.AbortRequestResponse(found=True)

    async def Stream(self, request_iterator, context):
        """The gateway's output stream: Reserve, Decode and Fork as above, one message each."""
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "reserve":
                yield pb.StepOutputs(reserved=[pb.StreamReserved(
                    request_id=msg.reserve.request_id,
                    reservation=await self.Reserve(msg.reserve, context))])
                continue
            if kind == "decode":
                self.calls.append(("Decode", msg.decode.request_id))
                req_id, token = msg.decode.request_id, msg.decode.first_token_id
            elif kind == "fork":
                self.calls.append(("Fork", f"{msg.fork.request_id}<"
                                           f"{msg.fork.parent_request_id}"))
                req_id, token = msg.fork.request_id, 7
            else:
                self.calls.append(("Abort", msg.abort.request_id))
                continue
            yield pb.StepOutputs(request_ids=[req_id], num_tokens=[1], token_ids=[token],
                                 texts=[""], ends=[pb.StreamEnd(
                                     index=0, finish_reason=FINISH_REASONS["length"])])


async def _serve(prefill: FakePrefill, decode: FakeDecode):
    server = grpc.aio.server()
    pb_grpc.add_PrefillServicer_to_server(prefill, server)
    pb_grpc.add_DecodeServicer_to_server(decode, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_samples_fork_on_the_parents_decode_worker_and_an_early_abort_reaches_none():
    prefill, decode = FakePrefill(), FakeDecode()

    async def scenario():
        server, address = await _serve(prefill, decode)
        backend = DisaggregatedBackend(StaticDiscovery([address], [address]), tokenizer=None)
        try:
            await backend.pools.discover()
            for w in backend.prefill + backend.decode:
                w.is_healthy = True
            params = SamplingParams(max_tokens=1)
            inputs = [GenerateInput(f"r-{i}", PROMPT, params, fork_of="r-0" if i else None)
                      for i in range(3)]

            async def collect(inp):
                return [c async for c in backend.generate(inp)]

            tasks = [asyncio.create_task(collect(inp)) for inp in inputs]
            await asyncio.sleep(0.3)  # the parent in Reserve, its forks waiting for it
            assert await backend.abort("r-2")
            decode.release.set()
            results = await asyncio.gather(*tasks)
            in_flight = [w.in_flight for w in backend.prefill + backend.decode]
            return results, in_flight, dict(backend.num_prefill_decisions)
        finally:
            await backend.close()
            await server.stop(None)

    (parent, child, aborted), in_flight, decisions = asyncio.run(scenario())
    assert [c.token_ids for c in parent] == [[42]] and parent[-1].finish_reason == "length"
    assert [c.token_ids for c in child] == [[7]]
    assert child[-1].timing.prefill_where == "fork"
    assert [c.finish_reason for c in aborted] == ["abort"]
    # one reservation, one prefill, one decision: the fork went straight to the decode worker
    assert prefill.calls == ["r-0"]
    assert sorted(decode.calls) == [("Decode", "r-0"), ("Fork", "r-1<r-0"), ("Reserve", "r-0")]
    assert sum(decisions.values()) == 1
    assert in_flight == [0, 0]
