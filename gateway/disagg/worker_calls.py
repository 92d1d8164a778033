"""What the disaggregated backend's steps share (gateway/disagg/backend.py, decode_admission.py,
prefill_handoff.py, canary.py): a lost worker, a request's time left, a worker's gRPC error as
the gateway's, and ending a request on a decode worker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from gateway.disagg.worker_pools import Worker
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import BackendUnavailable, DeadlineExceeded, GenerateInput


class WorkerLost(Exception):
    """A worker under a request failed UNAVAILABLE (died, restarted, unreachable); `pool`
    says at which stage: "prefill" (before the first token) or "decode"."""

    def __init__(self, pool: str, message: str) -> None:
        super().__init__(message)
        self.pool = pool


async def abort_on(decode: Worker, req_id: str) -> None:
    """End the request on the decode worker wherever it is (reserved or decoding); also when
    this task is being cancelled."""
    with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
        await asyncio.shield(decode.stub.Abort(pb.AbortRequestRequest(
            request_id=req_id, reason="ended at the gateway"), timeout=5.0))


def time_left(inp: GenerateInput) -> float | None:
    """Seconds to the request's deadline (0 once past it); None without one."""
    return None if inp.deadline is None else max(0.0, inp.deadline - time.monotonic())


def gateway_error(e: grpc.aio.AioRpcError, inp: GenerateInput) -> Exception:
    """A worker's gRPC error as the Backend interface's."""
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"request {inp.req_id!r} passed its deadline")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(e.details())
    return BackendUnavailable(f"{code.name}: {e.details()}")
