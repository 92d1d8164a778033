"""Admission on the decode pool: a request reserves KV blocks on the first decode worker (in
routing order, gateway/disagg/routing.py's rank_decode: the longest prefix of the prompt held
there, as decode workers publish it, against requests in flight from this gateway, then most
free blocks) that has room; when none has, it waits here, bounded in number (max_waiting) and
time (max_queue_wait_s or its deadline), woken when a request ends (request_ended())."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from gateway.disagg.routing import rank_decode
from gateway.disagg.worker_calls import abort_on, gateway_error, time_left
from gateway.disagg.worker_pools import REFRESH_S, Worker, WorkerPools
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import BackendUnavailable, DeadlineExceeded, GenerateInput, Overloaded


class DecodeAdmission:
    """Reservations on the decode pool of `pools`, and the requests waiting for one."""

    def __init__(self, pools: WorkerPools, lease_ttl_s: float, max_waiting: int,
                 max_queue_wait_s: float) -> None:
        # requests no decode worker has room for wait here (at most max_waiting at once, each
        # at most max_queue_wait_s or its deadline), else RESOURCE_EXHAUSTED
        if max_waiting < 0 or max_queue_wait_s < 0:
            raise ValueError(f"max_waiting and max_queue_wait_s must be >= 0, got "
                             f"{max_waiting} and {max_queue_wait_s}")
        self.pools = pools
        self.lease_ttl_s = lease_ttl_s
        self.max_waiting = max_waiting
        self.max_queue_wait_s = max_queue_wait_s
        self.num_waiting = 0
        self._freed = asyncio.Event()  # replaced each time a request ends

    def request_ended(self) -> None:
        """A request ended on the decode pool: wake the requests waiting for room."""
        self._freed.set()
        self._freed = asyncio.Event()

    async def decode_order(self, prompt: list[int]) -> list[Worker]:
        """The decode workers to ask, best first: overlaps from Redis when discovery has it
        (one round trip, bounded; unknown when it fails), else from the workers' Status."""
        pools = self.pools
        live = [w for w in pools.decode if w.is_healthy] or list(pools.decode)
        overlap = await pools.prefix_overlaps(prompt, live) if len(live) > 1 else None
        # in_flight is read after the await: other requests' picks meanwhile are counted
        order = rank_decode([w.in_flight for w in live],
                            [w.status.num_free_blocks if w.status else 0 for w in live], overlap)
        # last: workers no prefill worker could hand KV to lately (gateway/disagg/pair_health.py)
        prefills = [w.address for w in pools.prefill if w.is_healthy] or [
            w.address for w in pools.prefill]
        now = time.monotonic()
        return sorted((live[i] for i in order), key=lambda w: not pools.pair_health.has_good_pair(
            w.address, prefills, now))

    async def admit(self, inp: GenerateInput, sampling) -> tuple[Worker, pb.ReserveResponse]:
        """Reserve on a decode worker, waiting while every worker is full: woken when a
        request ends here, retried every REFRESH_S (other gateways' requests end unheard).
        At most max_waiting requests wait at once, each at most max_queue_wait_s. The worker
        returned counts the request in its in_flight."""
        got = await self.reserve(inp, sampling, time_left(inp))
        if got is not None:
            return got
        if self.num_waiting >= self.max_waiting:
            raise Overloaded(f"every decode worker is full and {self.max_waiting} requests "
                             f"already wait for one (max_waiting)")
        self.num_waiting += 1
        try:
            give_up = time.monotonic() + self.max_queue_wait_s
            while got is None:
                now = time.monotonic()
                if inp.deadline is not None and now >= inp.deadline:
                    raise DeadlineExceeded(f"request {inp.req_id!r} passed its deadline "
                                           f"waiting for a decode worker with room")
                if now >= give_up:
                    raise Overloaded(f"no decode worker had room within "
                                     f"{self.max_queue_wait_s} s (max_queue_wait_s)")
                wait = min(REFRESH_S, give_up - now, *(
                    () if inp.deadline is None else (inp.deadline - now,)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), timeout=wait)
                got = await self.reserve(inp, sampling, time_left(inp))
            return got
        finally:
            self.num_waiting -= 1

    async def reserve(self, inp: GenerateInput, sampling,
                      timeout) -> tuple[Worker, pb.ReserveResponse] | None:
        """Reserve on the first decode worker (in routing order) with room; None when every
        worker answered RESOURCE_EXHAUSTED; BackendUnavailable when none answered."""
        request = pb.ReserveRequest(request_id=inp.req_id, prompt_token_ids=inp.prompt_token_ids,
                                    sampling=sampling, lease_ttl_s=self.lease_ttl_s,
                                    num_prior_output_tokens=inp.num_prior_output_tokens)
        last_error, any_full = None, False
        for decode in await self.decode_order(inp.prompt_token_ids):
            # in flight from the pick on, so that a burst of requests spreads over the workers
            decode.in_flight += 1
            is_reserved = False
            try:
                reservation = await decode.outputs.reserve(request, timeout)
                is_reserved = True
                return decode, reservation
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    last_error = e
                    decode.is_healthy = e.code() != grpc.StatusCode.UNAVAILABLE
                    any_full |= decode.is_healthy
                    continue
                if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    await abort_on(decode, inp.req_id)  # it may have reserved in time
                raise gateway_error(e, inp) from None
            except asyncio.CancelledError:  # the worker may have reserved, unheard: undo it
                await abort_on(decode, inp.req_id)
                raise
            finally:
                if not is_reserved:
                    decode.in_flight -= 1
        if any_full:
            return None
        raise BackendUnavailable(f"no decode worker can take the request now: "
                                 f"{last_error.details() if last_error else 'none known'}")
