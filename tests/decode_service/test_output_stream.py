"""The decode worker's output stream (decode_service/stream.py) and the gateway's side of it
(gateway/disagg/decode_stream.py), over a real gRPC server on loopback, the engine a fake (one token
per step, milliseconds): every request's tokens arrive as the per-request Decode RPC gives
them; an abort ends one request and leaves the others; a start that cannot start is its own
error; the stream's end aborts what still runs on it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from decode_service.service import DecodeServicer
from engine_core.sampling_params import SamplingParams
from gateway.disagg.decode_stream import DecodeStream
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from protos.pdserve.v1 import generate_pb2 as v1
from service_infra.proto_convert import FINISH_REASON_NAMES
from tests.decode_service.test_decode_worker import FakeDecodeEngine, deliver


class Engine(FakeDecodeEngine):
    """Each reservation its own block, so that many can be leased at once."""

    def __init__(self) -> None:
        super().__init__()
        self.next_block = 0
        self.is_full = False  # every reservation refused (no room)
        self.is_broken = False  # every reservation raises (a bug)
        self.reserve_s = 0.0  # how long a reservation takes the engine thread

    def reserve(self, prompt, params, req_id, num_prior_output_tokens=0):
        time.sleep(self.reserve_s)
        if self.is_broken:
            raise RuntimeError("a bug in the engine")
        if self.is_full:
            return None
        self.reserved[req_id] = params
        self.next_block += 1
        return [self.next_block], 0


def run(body, step_s: float = 0.002):
    """body(worker, table, engine, stub, stream) with a decode worker served on loopback."""
    from decode_service.worker import DecodeWorker
    from kv_transfer import LeaseTable

    async def main():
        engine = Engine()
        engine.step_s = step_s
        holder = {}
        table = LeaseTable(on_release=lambda lease, why: holder["w"].on_lease_released(
            lease, why))
        worker = holder["w"] = DecodeWorker(engine, table)
        server = grpc.aio.server()
        engine.servicer = DecodeServicer(worker, "x")  # (the fake engine carries it to body)
        pb_grpc.add_DecodeServicer_to_server(engine.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.DecodeStub(channel)
        stream = DecodeStream(stub)
        try:
            return await body(worker, table, engine, stub, stream)
        finally:
            stream.close()
            await channel.close()
            await server.stop(None)
            await worker.close()

    return asyncio.run(main())


async def reserved(worker, table, req_id: str, max_tokens: int) -> None:
    res = await worker.reserve(req_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens),
                               ttl_s=5.0)
    deliver(table, res.lease_id, res.block_ids)


def reserve_request(req_id: str, max_tokens: int = 4, **fields) -> pb.ReserveRequest:
    return pb.ReserveRequest(**{
        "request_id": req_id, "prompt_token_ids": [1, 2, 3], "lease_ttl_s": 5.0,
        "sampling": v1.SamplingParameters(max_tokens=max_tokens), **fields})


def start(stream: DecodeStream, req_id: str, first_token: int):
    return stream.start(req_id, None, decode=pb.DecodeRequest(
        request_id=req_id, first_token_id=first_token, ready_timeout_s=1.0))


async def drain(channel) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async for delta in channel:
        tokens += delta.token_ids
        reason = FINISH_REASON_NAMES.get(delta.finish_reason)
    return tokens, reason


def test_every_request_streams_as_its_own_rpc_would():
    """Eight requests of different lengths share the stream; each gets exactly the tokens
    the per-request Decode RPC gives the same request, then its finish reason."""
    async def body(worker, table, engine, stub, stream):
        lengths = [1, 2, 3, 5, 8, 13, 4, 6]
        for i, n in enumerate(lengths):
            await reserved(worker, table, f"s{i}", n)
        got = await asyncio.gather(*(drain(start(stream, f"s{i}", 100 + i))
                                     for i in range(len(lengths))))
        want = []
        for i, n in enumerate(lengths):
            await reserved(worker, table, f"r{i}", n)
            msgs = [m async for m in stub.Decode(pb.DecodeRequest(
                request_id=f"r{i}", first_token_id=100 + i, ready_timeout_s=1.0))]
            want.append(([t for m in msgs for t in m.token_ids],
                         FINISH_REASON_NAMES.get(msgs[-1].finish_reason)))
        return got, want, engine.scheduler.requests

    got, want, left = run(body)
    assert got == want
    assert [len(t) for t, _ in got] == [1, 2, 3, 5, 8, 13, 4, 6]
    assert all(reason == "length" for _, reason in got) and left == {}


def test_an_abort_ends_one_request_and_leaves_the_others():
    async def body(worker, table, engine, stub, stream):
        for i in range(3):
            await reserved(worker, table, f"a{i}", 50)
        channels = [start(stream, f"a{i}", 1) for i in range(3)]
        first = await anext(channels[1])  # a1 is streaming
        stream.abort(channels[1], "the client left")
        others = await asyncio.gather(drain(channels[0]), drain(channels[2]))
        await worker.status()  # after the engine thread ran the abort
        return first, channels[1].is_done, others, engine.aborted, engine.scheduler.requests

    first, is_done, others, aborted, left = run(body)
    assert first.token_ids and is_done
    assert aborted == ["a1"] and left == {}
    assert [len(t) for t, _ in others] == [50, 50] and all(r == "length" for _, r in others)


def test_a_reservation_on_the_stream_is_the_reserve_calls():
    """A reserve message is answered as the Reserve call answers: the lease and blocks, the
    KV transfer's address, then the request starts on it and streams every token; and each
    refusal is the call's status and details: lease_ttl_s or sampling out of bounds and a
    request id already reserved INVALID_ARGUMENT, no room RESOURCE_EXHAUSTED, a draining
    worker UNAVAILABLE; a bug's exception is the call's UNKNOWN."""
    async def body(worker, table, engine, stub, stream):
        got = await stream.reserve(reserve_request("s", max_tokens=5), 5.0)
        by_call = await stub.Reserve(reserve_request("u"))
        deliver(table, got.lease_id, list(got.block_ids))
        streamed = await drain(start(stream, "s", 1))

        async def both(req_id, **fields):  # the call's error and the stream's, as pairs
            errors = []
            for reserve in (lambda r: stub.Reserve(r), lambda r: stream.reserve(r, 5.0)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await reserve(reserve_request(req_id, **fields))
                errors.append((e.value.code(), e.value.details()))
            return errors

        refused = {
            "ttl": await both("t", lease_ttl_s=0.0),
            "sampling": await both("p", sampling=v1.SamplingParameters(temperature=-1.0)),
            "twice": await both("u"),
        }
        engine.is_full = True
        refused["full"] = await both("f")
        engine.is_full = False
        engine.is_broken = True
        refused["broken"] = await both("b")
        engine.is_broken = False
        engine.servicer.drain()
        refused["draining"] = await both("d")
        return got, by_call, streamed, refused, set(worker.reservations)

    got, by_call, streamed, refused, reservations = run(body)
    assert got.lease_id and got.lease_id != by_call.lease_id
    assert (len(got.block_ids), got.num_cached_tokens, got.transfer_address) == (1, 0, "x")
    assert got.transfer_address == by_call.transfer_address
    assert streamed == ([1, 2, 3, 4, 5], "length")
    for why, (call, on_stream) in refused.items():
        assert call == on_stream or why == "broken" and call[0] == on_stream[0], why
    code = grpc.StatusCode
    assert refused["ttl"][0][0] == code.INVALID_ARGUMENT and "lease_ttl_s" in refused["ttl"][0][1]
    assert refused["sampling"][0][0] == code.INVALID_ARGUMENT
    assert "temperature" in refused["sampling"][0][1]
    assert refused["twice"][0] == (code.INVALID_ARGUMENT, "request_id 'u' is already reserved")
    assert refused["full"][0][0] == code.RESOURCE_EXHAUSTED
    assert refused["draining"][0][0] == code.UNAVAILABLE
    assert refused["broken"][0][0] == code.UNKNOWN and "a bug" in refused["broken"][1][1]
    assert reservations == {"u"}  # nothing refused was left reserved


def test_the_end_of_the_stream_ends_the_reservations_made_on_it():
    """The gateway goes away between reserving and starting (its prefill in flight): the
    reservations made on its stream end at once, not at their ttl, their blocks freed: those
    answered, one still being made when the stream ended (the gateway's reserve fails
    CANCELLED, its own stream closed), and one the gateway aborted on the stream. A reservation made by the
    Reserve call is not the stream's and stays."""
    async def body(worker, table, engine, stub, stream):
        answered = [await stream.reserve(reserve_request(f"a{i}"), 5.0) for i in range(2)]
        await stream.reserve(reserve_request("gone"), 5.0)
        stream._live().send(pb.StreamRequest(abort=pb.AbortRequestRequest(request_id="gone")))
        await stub.Reserve(reserve_request("by-call"))
        engine.reserve_s = 0.3
        late = asyncio.create_task(stream.reserve(reserve_request("late"), 5.0))
        await asyncio.sleep(0.1)  # its reservation under way in the engine thread
        stream.close()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await late
        deadline = time.monotonic() + 5
        while len(worker.reservations) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.4)  # the late one made and ended
        await worker.status()  # after the engine thread ran the aborts
        ended = [(lease.state.value, lease.reason) for lease in map(
            table.get, (r.lease_id for r in answered))]
        held = {lease.req_id for lease in table.leases()}
        return e.value.code(), ended, held, set(worker.reservations), sorted(engine.aborted)

    code, ended, held, reservations, aborted = run(body)
    assert code == grpc.StatusCode.CANCELLED
    assert reservations == held == {"by-call"}
    assert aborted == ["a0", "a1", "gone", "late"]
    assert ended == [("ABORTED", "the gateway's stream ended")] * 2


def test_a_reservation_the_gateway_gave_up_on_is_ended_once_made():
    """The engine is busy (a step in progress) while the deadline passes, or the gateway's
    task is cancelled: the reserve fails there (DEADLINE_EXCEEDED), and the reservation the
    worker makes after is ended at once, not left to its lease's ttl: the abort goes behind
    the reserve message on the same stream, which a unary Abort could overtake."""
    async def body(worker, table, engine, stub, stream):
        engine.reserve_s = 0.3
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stream.reserve(reserve_request("slow"), 0.05)
        cancelled = asyncio.create_task(stream.reserve(reserve_request("cancelled"), 5.0))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        deadline = time.monotonic() + 5
        while (len(engine.aborted) < 2 or worker.reservations) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await worker.status()
        return (e.value.code(), cancelled.cancelled(), set(worker.reservations),
                sorted(engine.aborted), [lease.req_id for lease in table.leases()])

    code, cancelled, reservations, aborted, leases = run(body)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and cancelled
    assert reservations == set() and leases == []
    assert aborted == ["cancelled", "slow"]


def test_a_request_that_cannot_start_fails_alone():
    """No reservation: its channel raises FAILED_PRECONDITION (what its own Decode RPC would
    end with); the request beside it is unaffected."""
    async def body(worker, table, engine, stub, stream):
        await reserved(worker, table, "ok", 4)
        bad, good = start(stream, "missing", 1), start(stream, "ok", 1)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await drain(bad)
        return e.value.code(), await drain(good)

    code, (tokens, reason) = run(body)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert len(tokens) == 4 and reason == "length"


def test_the_end_of_the_stream_aborts_what_runs_on_it():
    """The gateway goes away (its call is cancelled): every request still open on the
    stream is aborted on the worker, its blocks freed."""
    async def body(worker, table, engine, stub, stream):
        for i in range(3):
            await reserved(worker, table, f"g{i}", 1000)
        channels = [start(stream, f"g{i}", 1) for i in range(3)]
        for channel in channels:
            await anext(channel)
        stream.close()
        deadline = time.monotonic() + 5
        while engine.scheduler.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError):
            await drain(channels[0])
        return sorted(engine.aborted), engine.scheduler.requests

    aborted, left = run(body)
    assert aborted == ["g0", "g1", "g2"] and left == {}


def test_a_slow_reader_gets_merged_steps_and_every_token():
    """A consumer that does not read for a while: the steps it missed come merged into one
    delta, nothing lost, nothing repeated."""
    async def body(worker, table, engine, stub, stream):
        await reserved(worker, table, "slow", 30)
        channel = start(stream, "slow", 1)
        first = await anext(channel)
        await asyncio.sleep(0.2)  # ~100 steps of the fake engine
        rest = [d async for d in channel]
        return first, rest

    first, rest = run(body)
    tokens = first.token_ids + [t for d in rest for t in d.token_ids]
    assert tokens == [1, *range(2, 31)]
    assert len(rest) < 29  # merged: fewer deltas than tokens
    assert FINISH_REASON_NAMES.get(rest[-1].finish_reason) == "length"


def test_a_draining_worker_ends_the_stream_once_its_last_request_has():
    """The worker shuts down (drain) while a request runs: the request finishes, and the
    stream's call then ends by itself, also when that last request's end is the last thing
    written (no later wake-up comes), so the server's stop never waits out its grace."""
    async def body(worker, table, engine, stub, stream):
        await reserved(worker, table, "d", 20)
        channel = start(stream, "d", 1)
        await anext(channel)
        engine.servicer.drain()
        tokens, reason = await drain(channel)
        code = await asyncio.wait_for(stream._connection.call.code(), 2.0)
        return tokens, reason, code

    tokens, reason, code = run(body)
    assert reason == "length" and len(tokens) == 19
    assert code == grpc.StatusCode.OK


def test_a_draining_worker_starts_what_it_reserved_before_and_takes_nothing_new():
    """Drained while one request runs and another is reserved but not started (its KV on the
    way): a new Reserve is refused UNAVAILABLE (the gateway reserves elsewhere) and so is a
    start without a reservation, but the reserved request starts and streams every token;
    then the stream ends and the servicer reports itself drained."""
    async def body(worker, table, engine, stub, stream):
        await reserved(worker, table, "running", 20)
        running = start(stream, "running", 1)
        await anext(running)
        await reserved(worker, table, "reserved", 8)
        engine.servicer.drain()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Reserve(pb.ReserveRequest(request_id="new", prompt_token_ids=[1, 2, 3],
                                                 lease_ttl_s=5.0))
        with pytest.raises(grpc.aio.AioRpcError) as unreserved:
            await drain(start(stream, "unreserved", 1))
        late = await drain(start(stream, "reserved", 1))
        rest = await drain(running)
        await asyncio.wait_for(engine.servicer.drained(), 2.0)
        code = await asyncio.wait_for(stream._connection.call.code(), 2.0)
        return refused.value, unreserved.value.code(), late, rest, code, worker.reservations

    refused, unreserved, late, rest, code, reservations = run(body)
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "no new" in refused.details()
    assert unreserved == grpc.StatusCode.UNAVAILABLE
    assert late == (list(range(1, 9)), "length")
    assert len(rest[0]) == 19 and rest[1] == "length"
    assert code == grpc.StatusCode.OK and reservations == {}
