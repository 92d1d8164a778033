"""The gateway's DEADLINE_EXCEEDED status when the client's deadline and the backend's notice
race (seen once in the e2e suite: gRPC had ended the call as the gateway sent its status, and
grpc logged the failed send with a traceback)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.grpc_server import _abort_past_deadline
from service_infra.backend import DeadlineExceeded

ERR = DeadlineExceeded("request 'r' passed its deadline")


def test_the_status_is_sent_while_the_call_is_open():
    """Through grpc's own server on loopback: the backend gives up first, the gateway sends
    DEADLINE_EXCEEDED with its own message."""
    async def handler(request, context):
        await asyncio.sleep(0.05)
        await _abort_past_deadline(context, ERR)
        yield b"never"

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "t.T", {"Run": grpc.unary_stream_rpc_method_handler(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in channel.unary_stream("/t.T/Run")(b"", timeout=5.0):
                        pass
                return info.value
        finally:
            await server.stop(None)

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "passed its deadline" in err.details()


class EndedCall:
    """The two states of a call gRPC has ended that the race can show the gateway (the real
    race cannot be timed from a test: grpc cancels the handler when it ends the call)."""

    def __init__(self, done: bool, remaining: float, fails: bool) -> None:
        self._done, self.remaining, self.fails, self.sent = done, remaining, fails, []

    def done(self) -> bool:
        return self._done

    def time_remaining(self) -> float:
        return self.remaining

    async def abort(self, code, details):
        self.sent.append(code)
        if self.fails:  # grpc's core refused the batch: the call ended meanwhile
            self._done = True
            raise RuntimeError("execute_batch failed")
        raise grpc.aio.AbortError()


def test_nothing_is_sent_after_grpc_ended_the_call():
    call = EndedCall(True, -0.1, fails=False)
    asyncio.run(_abort_past_deadline(call, ERR))
    assert call.sent == []


def test_a_send_that_loses_the_race_is_not_an_error():
    call = EndedCall(False, 0.01, fails=True)
    asyncio.run(_abort_past_deadline(call, ERR))
    assert call.sent == [grpc.StatusCode.DEADLINE_EXCEEDED]


@pytest.mark.parametrize("remaining", [0.5, 0.0, -0.2])
def test_an_open_call_is_aborted(remaining):
    """Open even past its deadline (gRPC's timer has not fired yet): returning without a
    status would end it as OK."""
    call = EndedCall(False, remaining, fails=False)
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(_abort_past_deadline(call, ERR))
    assert call.sent == [grpc.StatusCode.DEADLINE_EXCEEDED]
