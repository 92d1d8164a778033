"""What the disaggregated backend's steps share (gateway/disagg/backend.py, decode_admission.py,
prefill_handoff.py): a lost worker, a request's time left, a worker's gRPC error as the
gateway's, and ending a request on a decode worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import grpc

from engine_core.kv_cache.block_hash import hash_full_blocks
from gateway.disagg.routing import MAX_ROUTING_BLOCKS, leading_overlap
from gateway.disagg.worker_pools import Worker
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import BackendUnavailable, DeadlineExceeded, GenerateInput


class WorkerLost(Exception):
    """A worker under a request failed UNAVAILABLE (died, restarted, unreachable); `pool`
    says at which stage: "prefill" (before the first token) or "decode"."""

    def __init__(self, pool: str, message: str) -> None:
        super().__init__(message)
        self.pool = pool


class WorkerCalls:
    """Helpers of the disaggregated backend's parts (mixed into DisaggregatedBackend: its
    discovery and block_size)."""

    async def _overlaps(self, prompt: list[int], workers: Sequence[Worker]) -> list[int] | None:
        """How many of the prompt's leading full blocks (up to MAX_ROUTING_BLOCKS) each worker
        caches: from Redis when discovery has it (one round trip, bounded; None when it
        fails), else from the workers' Status."""
        hashes = hash_full_blocks(prompt[:MAX_ROUTING_BLOCKS * self.block_size], self.block_size)
        if not hashes:
            return [0] * len(workers)
        query = getattr(self.discovery, "prefix_overlap", None)
        if query is None:
            return [leading_overlap(hashes, w.prefix_hashes) for w in workers]
        held = await query([w.worker_id for w in workers], hashes)
        return None if held is None else [held.get(w.worker_id, 0) for w in workers]

    @staticmethod
    async def _abort_on(decode: Worker, req_id: str) -> None:
        """End the request on the decode worker wherever it is (reserved or decoding); also
        when this task is being cancelled."""
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            await asyncio.shield(decode.stub.Abort(pb.AbortRequestRequest(
                request_id=req_id, reason="ended at the gateway"), timeout=5.0))

    @staticmethod
    def _remaining(inp: GenerateInput) -> float | None:
        return None if inp.deadline is None else max(0.0, inp.deadline - time.monotonic())

    @staticmethod
    def _error(e: grpc.aio.AioRpcError, inp: GenerateInput) -> Exception:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"request {inp.req_id!r} passed its deadline")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ValueError(e.details())
        return BackendUnavailable(f"{code.name}: {e.details()}")
