"""The prefill step of a disaggregated request: pick a prefill worker (gateway/disagg/routing.py),
send it the prompt with the decode worker's reservation (it pushes the KV there), and watch the
reservation's lease while it runs."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Sequence

import grpc

from gateway.disagg.routing import offload_weight, pick_prefill, routing_overlap
from gateway.disagg.worker_calls import WorkerLost, time_left
from gateway.disagg.worker_pools import Worker, WorkerPools
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import BackendUnavailable, GenerateInput, Overloaded

logger = logging.getLogger(__name__)


def overlaps_of(workers: Sequence[Worker], held: Sequence[tuple[int, int]]) -> list[float]:
    """routing_overlap of each prefill worker: held[i] is (leading blocks in its pool, in its
    pool or offload tiers); a tier block weighs what its measured load saves."""
    return [routing_overlap(pool, both, offload_weight(
        w.status.prefill_tokens_per_s, w.status.offload_load_tokens_per_s)
        if w.status is not None else 1.0) for w, (pool, both) in zip(workers, held, strict=True)]


class PrefillHandoff:
    """Prefills on the prefill pool of `pools`, the KV pushed to a decode worker's reservation.
    `bad_pairs`: the (prefill, decode) addresses the canary saw fail (gateway/disagg/canary.py's
    CanaryState.bad_pairs, the same set), avoided while others are left."""

    def __init__(self, pools: WorkerPools, transport: str, lease_ttl_s: float,
                 prefix_queue_weight: float, bad_pairs: set[tuple[str, str]]) -> None:
        self.pools = pools
        self.transport = transport
        self.lease_ttl_s = lease_ttl_s
        self.prefix_queue_weight = prefix_queue_weight  # see gateway/disagg/routing.py
        self.bad_pairs = bad_pairs

    async def pick_prefill(self, prompt: list[int], full: Sequence[Worker] = (),
                            decode: Worker | None = None,
                            held: dict[str, tuple[int, int]] | None = None) -> Worker:
        """gateway/disagg/routing.py's choice among the workers not in `full` (their queues refused
        this request) and, while others are left, not paired badly with `decode` (the canary
        saw that pair fail: gateway/disagg/canary.py); overlaps from `held` (the placement's, by
        address: blocks in the pool, in the pool or the offload tiers) or else from Redis or the
        workers' Status (WorkerPools.prefill_overlaps; unknown when Redis fails: queue depth
        alone)."""
        live = [w for w in self.pools.prefill if w.is_healthy] or list(self.pools.prefill)
        if decode is not None:  # pairs the canary or recent handoffs found failing
            bad, now = self.bad_pairs, time.monotonic()
            live = [w for w in live if (w.address, decode.address) not in bad
                    and not self.pools.pair_health.is_bad(w.address, decode.address, now)] or live
        if not live:
            raise BackendUnavailable("no prefill worker is known (discovery lists none)")
        live = [w for w in live if all(w is not f for f in full)]
        if not live:
            raise Overloaded(f"the queue of every prefill worker is full ({len(full)} "
                             f"refused the request: their --max-waiting)")
        overlap = None
        if len(live) > 1:
            pairs = [held.get(w.address, (0, 0)) for w in live] if held is not None \
                else await self.pools.prefill_overlaps(prompt, live)
            overlap = None if pairs is None else overlaps_of(live, pairs)
        return live[self.pick_of(prompt, live, overlap)]

    def pick_of(self, prompt: list[int], live: Sequence[Worker],
                 overlap: Sequence[float] | None) -> int:
        """gateway/disagg/routing.py's pick_prefill among `live` (in_flight read now: other
        requests' picks during an await are counted)."""
        key = zlib.crc32(bytes(str(prompt[:16]), "ascii"))  # same first block, same worker
        return pick_prefill([w.in_flight for w in live], overlap, key, self.prefix_queue_weight)

    async def prefill(self, inp: GenerateInput, sampling, decode: Worker,
                       res: pb.ReserveResponse,
                       held: dict[str, int] | None = None) -> pb.PrefillResponse:
        """Prefill on the best prefill worker whose queue takes the request (a full queue
        answers RESOURCE_EXHAUSTED: the next one is asked; Overloaded when all refuse).
        `held`: the prefix blocks the placement found on each prefill worker."""
        full: list[Worker] = []
        while True:
            prefill = await self.pick_prefill(inp.prompt_token_ids, full, decode,
                                               held)  # bounded
            try:
                return await self.prefill_on(prefill, inp, sampling, decode, res)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                full.append(prefill)

    async def prefill_on(self, prefill: Worker, inp: GenerateInput, sampling, decode: Worker,
                          res: pb.ReserveResponse) -> pb.PrefillResponse:
        first = res.num_cached_tokens // self.pools.block_size
        prefill.in_flight += 1
        prefill.num_tokens_in_flight += len(inp.prompt_token_ids)
        call = prefill.stub.Prefill(pb.PrefillRequest(
            request_id=inp.req_id, prompt_token_ids=inp.prompt_token_ids, sampling=sampling,
            num_prior_output_tokens=inp.num_prior_output_tokens,
            target=pb.KVTarget(transfer_address=res.transfer_address, lease_id=res.lease_id,
                               dst_block_ids=res.block_ids[first:], first_block=first,
                               transport=self.transport,
                               transfer_instance=res.transfer_instance)),
            timeout=time_left(inp))
        # why the watcher gave up on this call, and whether the transfer (not the prefill
        # worker) failed: a lease that ended unfinished says nothing about the worker's other
        # requests, so it is not marked unhealthy for it (that would give them all up)
        lost: list[tuple[str, bool]] = []

        def give_up(why: str, is_transfer: bool = False) -> None:
            lost.append((why, is_transfer))
            if is_transfer:  # the lease ended unfinished: the pair's transfer stalled
                self.pools.pair_health.failed(prefill.address, decode.address, time.monotonic())
            call.cancel()

        watcher = asyncio.create_task(self._watch_lease(decode, prefill, inp.req_id,
                                                        res.lease_id, give_up))
        try:
            reply = await call
            self.pools.pair_health.ok(prefill.address, decode.address)
            return reply
        except asyncio.CancelledError:
            if not lost:  # our own task is being cancelled (client gone, deadline)
                raise
            why, is_transfer = lost[0]
            if not is_transfer:
                prefill.is_healthy = False
            raise WorkerLost("prefill", why) from None
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            # the prefill worker is gone, or the KV transfer failed (decode side gone, lease
            # expired): either way nothing was decoded yet and the reservation is void
            if not (e.details() or "").startswith("kv transfer failed"):
                prefill.is_healthy = False  # routing avoids it until it answers Status again
            else:  # both answer us, not each other (or D is gone): avoid the pair a while
                self.pools.pair_health.failed(prefill.address, decode.address, time.monotonic())
            raise WorkerLost("prefill", f"prefill worker {prefill.address}: "
                                        f"{e.details()}") from None
        finally:
            watcher.cancel()
            prefill.in_flight -= 1
            prefill.num_tokens_in_flight -= len(inp.prompt_token_ids)

    async def _watch_lease(self, decode: Worker, prefill: Worker, req_id: str, lease_id: str,
                           give_up: Callable[[str], None]) -> None:
        """While the Prefill call runs, every third of the lease ttl: renew the lease while
        the prompt waits in the prefill queue, however long (RESERVED); once the transfer has
        begun, only watch (its deadline stands: a transfer without progress for a ttl
        expires). give_up(why) when the lease has ended (expired: the transfer stalled;
        aborted) or the prefill worker stopped answering Status (stalled: a stopped process
        keeps its connections). Without this gateway (crashed, partitioned) nobody renews and
        the lease expires within one ttl, freeing the blocks."""
        request = pb.RenewLeaseRequest(request_id=req_id, lease_id=lease_id,
                                       lease_ttl_s=self.lease_ttl_s)
        period = self.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            if not prefill.is_healthy:
                give_up(f"prefill worker {prefill.address} stopped answering")
                return
            try:
                await decode.stub.RenewLease(request, timeout=period)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    give_up(f"the KV transfer from {prefill.address} did not complete: "
                            f"{e.details()}", is_transfer=True)
                    return
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # that: transfer running
                    logger.warning("renewing the lease of %s on %s failed (%s): %s; retrying",
                                   req_id, decode.address, e.code().name, e.details())
