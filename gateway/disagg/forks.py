"""Forks in the disaggregated backend: the n samples of one prompt reserve, prefill and hand
off its KV once. Sample 0 (the parent) runs as any request; samples 1..n-1
(`GenerateInput.fork_of`) go to the parent's decode worker as Fork calls, which share the
prompt's blocks there (decode_service/worker.py, engine_core/scheduler.py).

    parent  generate(): registers its placement; once its Reserve holds blocks, the
            placement is (its decode worker, its request id there)
    child   generate(): waits for the parent's placement, then D.Fork(parent id) in place of
            Reserve / Prefill / Decode. No placement (the parent ended before reserving, or
            is not running here): the child runs as a request of its own.

The first token: the prefill worker samples only the parent's. Each child recomputes the
prompt's last token on the decode worker (one token of compute, over the shared KV) and
samples its own first token from those logits with its own sampling state (seed + i,
penalties, grammar), so a seeded sample reproduces a single request with that seed.

Accounting: a fork counts in its decode worker's in_flight like any request there (routing
and admission see its load); it holds no reservation or lease of its own (its blocks are the
parent's until it writes one; the worker's engine admits it under max_num_seqs and its pool
like any waiting request); it never calls a prefill worker, so no prefill decision or handoff
is counted for it. A lost decode worker makes it a continuation of its own (its parent went
with that worker).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from gateway.disagg.decode_stream import RequestChannel
from gateway.disagg.prefill_policy import PrefillDecision
from gateway.disagg.worker_calls import time_left
from gateway.disagg.worker_pools import Worker
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import DeadlineExceeded, GenerateInput

FORK_DECISION = PrefillDecision("fork", "shared_prompt")  # a child's Timing.prefill_where


@dataclass(frozen=True)
class Placement:
    decode: Worker
    worker_req_id: str  # the parent's id on that worker


class ForkPlacements:
    """Where each running parent reserved, for its forks; the forks waiting to know."""

    def __init__(self) -> None:
        # client request id of a running parent -> its placement, once it has reserved
        self._placements: dict[str, asyncio.Future[Placement | None]] = {}
        self._waiting_forks: set[str] = set()  # children waiting for their parent's placement

    @contextlib.contextmanager
    def as_parent(self, inp: GenerateInput):
        """While the request runs, its forks can find where it is."""
        if inp.fork_of is not None:
            yield
            return
        fut = asyncio.get_running_loop().create_future()
        self._placements[inp.req_id] = fut
        try:
            yield
        finally:
            if self._placements.get(inp.req_id) is fut:
                del self._placements[inp.req_id]
            if not fut.done():
                fut.set_result(None)

    def placed(self, client_id: str, decode: Worker, worker_req_id: str) -> None:
        fut = self._placements.get(client_id)
        if fut is not None and not fut.done():
            fut.set_result(Placement(decode, worker_req_id))

    async def parent_placement(self, inp: GenerateInput) -> Placement | None:
        """Where the child's parent reserved; None when it runs nowhere (the child runs on
        its own). DeadlineExceeded if the child's deadline passes first."""
        fut = self._placements.get(inp.fork_of) if inp.fork_of is not None else None
        if fut is None:
            return None
        self._waiting_forks.add(inp.req_id)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), time_left(inp))
        except TimeoutError:
            raise DeadlineExceeded(f"request {inp.req_id!r} passed its deadline") from None
        finally:
            self._waiting_forks.discard(inp.req_id)

    def is_waiting(self, req_id: str) -> bool:
        """The fork waits for its parent's placement (not running anywhere yet)."""
        return req_id in self._waiting_forks

    @staticmethod
    def start(inp: GenerateInput, sampling, placement: Placement) -> RequestChannel:
        """The fork's start on its parent's decode worker's output stream."""
        return placement.decode.outputs.start(inp.req_id, inp.deadline, fork=pb.ForkRequest(
            request_id=inp.req_id, parent_request_id=placement.worker_req_id,
            prompt_token_ids=inp.prompt_token_ids, sampling=sampling))
