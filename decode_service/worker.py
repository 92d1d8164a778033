"""The decode worker: the engine thread of the colocated backend, plus reservations whose
prompt KV arrives from a prefill worker under a lease.

    Reserve:  engine.reserve (blocks for the prompt; a cached prefix needs no transfer)
              -> lease on the blocks to be written -> (lease id, block ids) to the gateway
    ...prefill worker writes the blocks and commits; the receiver verifies checksums...
    Decode:   lease COMPLETE -> claim -> engine.admit_prefilled(first token) -> stream
    PrefillLocally (the gateway's choice, gateway/disagg/prefill_policy.py): the lease is withdrawn
              before any sender began, the engine computes the prompt in the reserved
              blocks (chunked beside the running decodes) and samples the first token
    Fork:     another sample of a reserved or running request: the engine forks it from
              the parent's prompt KV once that is here (engine_core/scheduler.py), so a
              prompt with n samples is reserved, prefilled and handed off once
    Any end before the claim (abort, expiry, failed verification, peer death noticed as
    expiry) releases the lease, and its release aborts the reserved request: the blocks go
    back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine_core.engine import LLMEngine
from engine_core.kv_cache.block_hash import hash_full_blocks
from engine_core.outputs import RequestDelta
from engine_core.sampling_params import SamplingParams
from kv_transfer import Lease, LeaseError, LeaseState, LeaseTable, UnknownLeaseError
from service_infra.backend import GenerateChunk, GenerateInput
from service_infra.colocated import ColocatedBackend, StartRequest
from service_infra.prefix_record import PrefixRecord

logger = logging.getLogger(__name__)
READY_POLL_S = 0.002
MAX_RECORDED_BLOCKS = 128  # leading blocks of a prompt recorded for routing (the gateway's
#                            gateway/disagg/routing.py MAX_ROUTING_BLOCKS: longer overlaps count equal)


def fork_input(req_id: str, parent_req_id: str, prompt_token_ids: list[int],
               params: SamplingParams) -> GenerateInput:
    """A sample of `parent_req_id` that shares its prompt KV (see DecodeWorker.fork)."""
    return GenerateInput(req_id, list(prompt_token_ids), params, fork_of=parent_req_id)


class LeaseNotReady(RuntimeError):
    """The lease ended without complete, verified KV (the reason is in the message)."""


@dataclass
class Reservation:
    req_id: str
    lease_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]  # every prompt block
    num_cached_tokens: int  # prompt tokens already cached here (not transferred)


class DecodeWorker(ColocatedBackend):
    """Create inside the running event loop (like ColocatedBackend)."""

    def __init__(self, engine: LLMEngine, lease_table: LeaseTable,
                 on_prefix: Callable[[list[int]], None] | None = None) -> None:
        """on_prefix(block hashes): the full blocks of a prompt now held here (the server
        publishes them to Redis when registered; must not block or raise)."""
        super().__init__(engine)
        self.leases = lease_table
        self.reservations: dict[str, Reservation] = {}  # loop side; until claimed or ended
        self.prefix = PrefixRecord(max(1, engine.num_kv_blocks))  # what Status publishes
        self.on_prefix = on_prefix

    def held(self, prompt_token_ids: list[int]) -> None:
        """The prompt's full blocks are in this worker's prefix cache now: record them for
        the gateways' routing (service_infra/prefix_record.py)."""
        bs = self.engine.layout.block_size
        hashes = hash_full_blocks(prompt_token_ids[:MAX_RECORDED_BLOCKS * bs], bs)
        if not hashes:
            return
        self.prefix.add(hashes)
        if self.on_prefix is not None:
            self.on_prefix(hashes)

    async def _recording_reply(self, chunks: AsyncIterator[GenerateChunk],
                               prompt_token_ids: list[int]) -> AsyncIterator[GenerateChunk]:
        """Pass the chunks on; at the last, record the reply (`finished`)."""
        keeps_replies = self.engine.kv.cache_decoded_blocks
        output: list[int] = []
        async for chunk in chunks:
            if keeps_replies:
                output += chunk.token_ids
                if chunk.is_last:
                    self.finished(prompt_token_ids, output)
            yield chunk

    # -- called by the lease table, from any thread -------------------------------------------
    def on_lease_released(self, lease: Lease, reason: str) -> None:
        logger.info("lease %s of %s released (%s): %s", lease.lease_id, lease.req_id,
                    lease.state.value, reason)
        self.submit_to_engine(lambda: self.engine.abort_request(lease.req_id))
        self.loop.call_soon_threadsafe(self.reservations.pop, lease.req_id, None)

    # -- the decode verbs (event loop) ----------------------------------------------------------
    async def reserve(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      ttl_s: float, num_prior_output_tokens: int = 0) -> Reservation | None:
        """Blocks for the prompt and a lease on those to be written; None when full."""
        if req_id in self.reservations:
            raise ValueError(f"request_id {req_id!r} is already reserved")
        try:
            got = await self.call_in_engine(
                lambda: self.engine.reserve(prompt_token_ids, params, req_id,
                                            num_prior_output_tokens))
        except asyncio.CancelledError:
            # the caller is gone (cancel, deadline) while the engine thread had not yet run the
            # reservation, which it still will: undo it right after (the inbox is in order)
            self.submit_to_engine(lambda: self.engine.abort_request(req_id))
            raise
        if got is None:
            return None
        blocks, num_cached = got
        first = num_cached // self.engine.layout.block_size
        try:
            lease = self.leases.open(req_id, blocks[first:], ttl_s)
        except ValueError:
            await self.call_in_engine(lambda: self.engine.abort_request(req_id))
            raise
        res = Reservation(req_id, lease.lease_id, list(prompt_token_ids), params, blocks,
                          num_cached)
        self.reservations[req_id] = res
        return res

    async def claim(self, req_id: str, first_token: int,
                    first_logprobs: dict[int, float] | None,
                    ready_timeout_s: float) -> tuple[GenerateInput, StartRequest]:
        """Wait for the reservation's KV to be complete and verified, claim it, and return
        the request with how the engine thread admits it (its first token's delta).
        LeaseNotReady when the lease ended or the KV is not complete in time."""
        res = self.reservations.get(req_id)
        if res is None:
            raise LeaseNotReady(f"no reservation for request {req_id!r} (never made, "
                                f"expired or aborted)")
        deadline = time.monotonic() + ready_timeout_s
        while True:
            lease = self.leases.get(res.lease_id)
            state = lease.state if lease else None
            if state is LeaseState.COMPLETE:
                break
            if state is None or state.is_terminal or time.monotonic() > deadline:
                self.leases.abort(res.lease_id, "decode could not start")
                why = lease.reason if lease and lease.reason else f"state {state}"
                raise LeaseNotReady(f"KV of {req_id!r} is not complete: {why}")
            await asyncio.sleep(READY_POLL_S)
        self.leases.claim(res.lease_id)  # the engine's reservation now owns the blocks
        del self.reservations[req_id]

        def admit() -> list[RequestDelta]:  # the engine thread: the first token's delta
            try:
                return [self.engine.admit_prefilled(req_id, first_token, first_logprobs)]
            except (KeyError, ValueError) as e:
                raise ValueError(f"cannot admit: {e!r}") from e

        self.held(res.prompt_token_ids)  # verified KV, cached at admission
        return GenerateInput(req_id, res.prompt_token_ids, res.params), admit

    def withdraw(self, req_id: str, lease_id: str,
                 max_chunk_tokens: int) -> tuple[GenerateInput, StartRequest]:
        """Take the reservation back from its lease for a local prefill; returns the request
        with how the engine thread starts computing its prompt. LeaseNotReady if the lease
        ended or a sender has begun writing into it."""
        if max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        res = self.reservations.get(req_id)
        if res is None or res.lease_id != lease_id:
            raise LeaseNotReady(f"no reservation for request {req_id!r} under lease "
                                f"{lease_id!r} (never made, expired or aborted)")
        try:
            self.leases.withdraw(lease_id)
        except LeaseError as e:
            raise LeaseNotReady(f"cannot prefill {req_id!r} locally: {e}") from None
        del self.reservations[req_id]

        def start() -> list[RequestDelta]:  # the engine thread
            try:
                self.engine.prefill_reserved(req_id, max_chunk_tokens)
            except KeyError as e:  # aborted in between
                raise ValueError(f"cannot prefill locally: {e!r}") from e
            return []

        return GenerateInput(req_id, res.prompt_token_ids, res.params), start

    def finished(self, prompt_token_ids: list[int], output: list[int]) -> None:
        """A request that streamed `output` ended: where the engine keeps decoded blocks
        (--cache-decoded-blocks), record the reply's full blocks too, so that a chat's next
        turn is routed by its whole history. Every token but the last has its KV computed."""
        if self.engine.kv.cache_decoded_blocks and len(output) > 1:
            self.held(prompt_token_ids + output[:-1])

    async def decode(self, req_id: str, first_token: int,
                     first_logprobs: dict[int, float] | None,
                     ready_timeout_s: float) -> AsyncIterator[GenerateChunk]:
        """Claim the reservation's verified KV and stream every token from the first on."""
        inp, admit = await self.claim(req_id, first_token, first_logprobs, ready_timeout_s)
        async for chunk in self._recording_reply(self.generate(inp, start=admit),
                                                 inp.prompt_token_ids):
            yield chunk

    async def prefill_locally(self, req_id: str, lease_id: str,
                              max_chunk_tokens: int) -> AsyncIterator[GenerateChunk]:
        """Compute the reservation's prompt in this engine and stream every token from the
        first on. The blocks stay the reservation's throughout (admission counted them);
        LeaseNotReady if the lease ended or a sender has begun writing into it."""
        inp, start = self.withdraw(req_id, lease_id, max_chunk_tokens)
        is_first = True
        async for chunk in self._recording_reply(self.generate(inp, start=start),
                                                 inp.prompt_token_ids):
            if is_first:  # the first token: the whole prompt is computed and cached
                is_first = False
                self.held(inp.prompt_token_ids)
            yield chunk

    async def fork(self, req_id: str, parent_req_id: str, prompt_token_ids: list[int],
                   params: SamplingParams) -> AsyncIterator[GenerateChunk]:
        """Stream a sample of `parent_req_id` that shares its prompt KV; with no such parent
        here (gone, or another prompt) it prefills here as a plain request."""
        async for chunk in self.generate(fork_input(req_id, parent_req_id, prompt_token_ids,
                                                    params)):
            yield chunk

    def renew(self, req_id: str, lease_id: str, ttl_s: float) -> float:
        """Extend the RESERVED lease of a queued prompt; the seconds left after renewal.
        LeaseError if the transfer has begun or the lease has ended (or is not req_id's)."""
        res = self.reservations.get(req_id)
        if res is None or res.lease_id != lease_id:
            raise UnknownLeaseError(lease_id, f"no reservation of request {req_id!r} holds it")
        lease = self.leases.renew(lease_id, ttl_s, required=LeaseState.RESERVED)
        return lease.deadline - self.leases.now()

    def release(self, req_id: str, lease_id: str, reason: str) -> bool:
        """End req_id's reservation if it is still the one under lease_id, not claimed or
        withdrawn (a stream that made it ended, decode_service/stream.py)."""
        res = self.reservations.get(req_id)
        if res is None or res.lease_id != lease_id:
            return False
        del self.reservations[req_id]
        self.leases.abort(lease_id, reason)  # its release aborts the engine request
        return True

    async def abort_anywhere(self, req_id: str, reason: str) -> bool:
        res = self.reservations.get(req_id)
        if res is not None:
            return self.release(req_id, res.lease_id, reason)
        return await self.abort(req_id)

    async def status(self) -> dict:
        result = await super().status()
        result["num_reserved"] = len(self.reservations)
        result["num_leases"] = len(self.leases.leases())
        return result

    def status_now(self) -> dict:
        result = super().status_now()
        result["num_reserved"] = len(self.reservations)
        return result
