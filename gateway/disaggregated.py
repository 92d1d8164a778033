"""The disaggregated backend: the gateway drives each request through a decode worker's
reservation, a prefill worker's KV handoff, and the decode worker's stream.

    generate(inp):
      pick decode D (fewest requests in flight from here, then most free KV blocks)
      D.Reserve(prompt)                -> lease + destination blocks (a prefix D caches is
                                          not sent again); RESOURCE_EXHAUSTED -> next D;
                                          all full -> wait for a request to end (bounded)
      pick prefill P (most leading prompt blocks cached there, as the Redis registry knows,
                                          against the queue from here: gateway/routing.py;
                                          equal: the prompt's first block picks one, so shared
                                          prefixes land on the same cache)
      while P runs it: D.RenewLease every lease_ttl / 3 (queues may be long; a gateway that
                                          dies stops renewing, the lease expires); a lease that
                                          ended or a P that stalled -> run it elsewhere
      P.Prefill(prompt, lease, blocks) -> KV pushed layer by layer, committed, verified;
                                          the first token
      D.Decode(first token)            -> stream of chunks to the client
    Cancellation or a deadline at any point: the pending call is cancelled (gRPC propagates it
    to the worker, which aborts) and D.Abort ends the reservation or the decode.

The pools themselves (following discovery, health from Status) are gateway/worker_pools.py;
this backend is one.

Timing (seconds since arrival): queue = routing and reservation + the prefill worker's queue,
prefill = its compute, kv_transfer = first token sampled -> first token delivered by D (the
un-overlapped transfer tail, verification and admission), so queue + prefill + kv_transfer =
ttft exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc

from engine_core.kv_cache.block_hash import hash_full_blocks
from gateway.backend import (
    BackendUnavailable,
    DeadlineExceeded,
    DuplicateRequestError,
    GenerateChunk,
    GenerateInput,
    ModelInfo,
    Overloaded,
    Timing,
)
from gateway.discovery import Discovery
from gateway.routing import MAX_ROUTING_BLOCKS, QUEUE_WEIGHT_BLOCKS, pick_prefill
from gateway.worker_pools import REFRESH_S, Worker, WorkerPools
from pdserve.tls import TLSConfig
from protos.convert import (
    FINISH_REASON_NAMES,
    logprob_from_proto,
    sampling_to_proto,
)
from protos.pdserve.internal import workers_pb2 as pb

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 3  # a request survives two lost workers (prefill, decode or transfer)


class WorkerLost(Exception):
    """A worker under a request failed UNAVAILABLE (died, restarted, unreachable); `pool`
    says at which stage: "prefill" (before the first token) or "decode"."""

    def __init__(self, pool: str, message: str) -> None:
        super().__init__(message)
        self.pool = pool


def _continuation(inp: GenerateInput, emitted: list[int], attempt: int) -> GenerateInput | None:
    """Attempt `attempt` of a request: the first as given; a later one under its own id on the
    workers, continuing after the tokens already streamed (None: nothing left to generate).
    The continuation is prefilled afresh (a seeded request's randomness restarts with it)."""
    if attempt == 0:
        return inp
    n, p = len(emitted), inp.params
    if n >= p.max_tokens:
        return None
    return replace(inp, req_id=f"{inp.req_id}~{attempt}",
                   prompt_token_ids=[*inp.prompt_token_ids, *emitted],
                   params=replace(p, max_tokens=p.max_tokens - n,
                                  min_tokens=max(0, p.min_tokens - n)))


class DisaggregatedBackend(WorkerPools):
    def __init__(self, discovery: Discovery, tokenizer, transport: str = "auto",
                 lease_ttl_s: float = 30.0, model_name: str | None = None,
                 max_waiting: int = 1024, max_queue_wait_s: float = 300.0,
                 prefix_queue_weight: float = QUEUE_WEIGHT_BLOCKS,
                 tls: TLSConfig | None = None) -> None:
        super().__init__(discovery, tls)
        self.prefix_queue_weight = prefix_queue_weight  # see gateway/routing.py
        # admission: requests no decode worker has room for wait here (at most max_waiting at
        # once, each at most max_queue_wait_s or its deadline), else RESOURCE_EXHAUSTED
        if max_waiting < 0 or max_queue_wait_s < 0:
            raise ValueError(f"max_waiting and max_queue_wait_s must be >= 0, got "
                             f"{max_waiting} and {max_queue_wait_s}")
        self.max_waiting = max_waiting
        self.max_queue_wait_s = max_queue_wait_s
        self.num_admission_waiting = 0
        self._freed = asyncio.Event()  # replaced each time a request ends here
        self.tokenizer = tokenizer
        self.transport = transport
        self.lease_ttl_s = lease_ttl_s
        self._model_name = model_name
        self.model: ModelInfo | None = None
        # client's req_id -> (its decode worker, the attempt's request id on the workers)
        self._running: dict[str, tuple[Worker, str]] = {}
        self.num_migrations = {"prefill": 0, "decode": 0}  # requests run again, by lost stage
        self._aborted: set[str] = set()  # running requests the client aborted
        self.block_size = 16  # the workers' (from their status at start)

    async def start(self, max_model_len: int, vocab_size: int, timeout_s: float = 120.0) -> None:
        """Wait until every worker answers and check they serve one model with one KV layout."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh()
            if self.prefill and self.decode and all(
                    w.is_healthy for w in self.prefill + self.decode):
                break
            if time.monotonic() > deadline:
                down = [w.address for w in self.prefill + self.decode if not w.is_healthy]
                raise BackendUnavailable(f"workers did not answer within {timeout_s} s: {down}")
            await asyncio.sleep(0.5)
        layouts = {(w.status.model, w.status.layout_fingerprint)
                   for w in self.prefill + self.decode}
        if len(layouts) != 1:
            raise ValueError(f"workers disagree on model / KV layout: {sorted(layouts)}")
        (model, self.layout_fingerprint), = layouts
        self.block_size = self.decode[0].status.block_size
        min_pool = min(w.status.num_blocks for w in self.decode) * self.block_size
        self.model = ModelInfo(self._model_name or model, min(max_model_len, min_pool),
                               vocab_size)
        self._refresher = asyncio.create_task(self._refresh_loop())

    # -- routing --------------------------------------------------------------------------------
    def _decode_order(self) -> list[Worker]:
        live = [w for w in self.decode if w.is_healthy] or list(self.decode)
        free = {id(w): w.status.num_free_blocks if w.status else 0 for w in live}
        return sorted(live, key=lambda w: (w.in_flight, -free[id(w)]))

    async def _pick_prefill(self, prompt: list[int], full: Sequence[Worker] = ()) -> Worker:
        """gateway/routing.py's choice among the workers not in `full` (their queues refused
        this request); overlaps from discovery when it knows them (one round trip, bounded;
        unknown when it fails: queue depth alone)."""
        live = [w for w in self.prefill if w.is_healthy] or list(self.prefill)
        if not live:
            raise BackendUnavailable("no prefill worker is known (discovery lists none)")
        live = [w for w in live if all(w is not f for f in full)]
        if not live:
            raise Overloaded(f"the queue of every prefill worker is full ({len(full)} "
                             f"refused the request: their --max-waiting)")
        overlap = None
        query = getattr(self.discovery, "prefix_overlap", None)
        if query is not None and len(live) > 1:
            hashes = hash_full_blocks(prompt[:MAX_ROUTING_BLOCKS * self.block_size],
                                      self.block_size)
            held = await query([w.worker_id for w in live], hashes) if hashes else None
            if held is not None:
                overlap = [held.get(w.worker_id, 0) for w in live]
        key = zlib.crc32(bytes(str(prompt[:16]), "ascii"))  # same first block, same worker
        # in_flight is read after the await: other requests' picks meanwhile are counted
        return live[pick_prefill([w.in_flight for w in live], overlap, key,
                                 self.prefix_queue_weight)]

    # -- the Backend interface --------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """Run the request; if a worker dies under it (prefill, decode or the KV transfer
        between them fails UNAVAILABLE), run it again elsewhere, up to MAX_ATTEMPTS: before
        its first token from scratch, after it as a continuation (prompt + the tokens already
        streamed), so the client's stream goes on."""
        if inp.req_id in self._running:
            raise DuplicateRequestError(f"request_id {inp.req_id!r} is already running")
        emitted: list[int] = []  # tokens streamed to the client, all attempts
        for attempt in range(MAX_ATTEMPTS):
            winp = _continuation(inp, emitted, attempt)
            if winp is None:  # the worker died after the last token, before the finish
                yield GenerateChunk([], "", None, "length", len(inp.prompt_token_ids),
                                    len(emitted))
                return
            base = len(emitted)
            try:  # aclosing: a client that goes away ends the attempt (and its reservation) now
                async with contextlib.aclosing(self._run(winp, inp.req_id)) as chunks:
                    async for chunk in chunks:
                        chunk.num_prompt_tokens = len(inp.prompt_token_ids)
                        chunk.num_output_tokens += base
                        emitted.extend(chunk.token_ids)
                        yield chunk
                return
            except WorkerLost as e:
                self.num_migrations[e.pool] += 1
                if attempt + 1 == MAX_ATTEMPTS:
                    raise BackendUnavailable(f"request {inp.req_id!r} lost a worker "
                                             f"{MAX_ATTEMPTS} times; last: {e}") from None
                logger.warning("request %s: %s; running it again elsewhere (%d tokens "
                               "streamed so far)", inp.req_id, e, len(emitted))

    async def _run(self, inp: GenerateInput, client_id: str) -> AsyncIterator[GenerateChunk]:
        """One attempt: reserve, prefill, decode; inp.req_id is this attempt's id on the
        workers, client_id the gateway's (what abort() is called with)."""
        sampling = sampling_to_proto(inp.params)
        decode, reservation = await self._admit(inp, sampling)  # counted in flight
        self._running[client_id] = (decode, inp.req_id)
        is_done = False
        try:
            t_prefill_call = time.monotonic()
            pre = await self._prefill(inp, sampling, decode, reservation)
            num_out, t_first = 0, None
            call = decode.stub.Decode(pb.DecodeRequest(
                request_id=inp.req_id, first_token_id=pre.first_token_id,
                first_logprob=pre.first_logprob if pre.HasField("first_logprob") else None,
                ready_timeout_s=READY_TIMEOUT_S), timeout=self._remaining(inp))
            try:
                async for msg in call:
                    now = time.monotonic()
                    t_first = t_first or now
                    num_out += len(msg.token_ids)
                    reason = FINISH_REASON_NAMES.get(msg.finish_reason)
                    chunk = GenerateChunk(
                        list(msg.token_ids), msg.text,
                        [logprob_from_proto(lp) for lp in msg.logprobs] if msg.logprobs
                        else None, reason, len(inp.prompt_token_ids), num_out,
                        msg.num_cached_tokens)
                    if reason is not None:
                        queue = (t_prefill_call - inp.arrival) + pre.queue_s
                        ttft = t_first - inp.arrival
                        chunk.timing = Timing(queue, pre.compute_s,
                                              ttft - queue - pre.compute_s,
                                              msg.first_decode_step_s, ttft, now - inp.arrival)
                        is_done = True
                    yield chunk
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and client_id not in self._aborted:
                    decode.is_healthy = False
                    raise WorkerLost("decode", f"decode worker {decode.address}: "
                                           f"{e.details()}") from None
                raise
        except (grpc.aio.AioRpcError, WorkerLost) as e:
            if client_id not in self._aborted:  # (the client's abort also ends the handoff)
                raise e if isinstance(e, WorkerLost) else self._error(e, inp) from None
            is_done = True  # aborted before decoding began: end the stream like the engine does
            yield GenerateChunk([], "", None, "abort", len(inp.prompt_token_ids), 0)
        finally:
            self._aborted.discard(client_id)
            decode.in_flight -= 1
            self._running.pop(client_id, None)
            if not is_done:  # cancelled, deadline, or a failure: free it on the decode worker
                await self._abort_on(decode, inp.req_id)
            self._freed.set()  # wake the requests waiting for decode capacity
            self._freed = asyncio.Event()

    async def _admit(self, inp: GenerateInput, sampling) -> tuple[Worker, pb.ReserveResponse]:
        """Reserve on a decode worker, waiting while every worker is full: woken when a
        request ends here, retried every REFRESH_S (other gateways' requests end unheard).
        At most max_waiting requests wait at once, each at most max_queue_wait_s."""
        got = await self._reserve(inp, sampling, self._remaining(inp))
        if got is not None:
            return got
        if self.num_admission_waiting >= self.max_waiting:
            raise Overloaded(f"every decode worker is full and {self.max_waiting} requests "
                             f"already wait for one (max_waiting)")
        self.num_admission_waiting += 1
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
                got = await self._reserve(inp, sampling, self._remaining(inp))
            return got
        finally:
            self.num_admission_waiting -= 1

    async def _reserve(self, inp: GenerateInput, sampling,
                       timeout) -> tuple[Worker, pb.ReserveResponse] | None:
        """Reserve on the first decode worker (in routing order) with room; None when every
        worker answered RESOURCE_EXHAUSTED; BackendUnavailable when none answered."""
        request = pb.ReserveRequest(request_id=inp.req_id, prompt_token_ids=inp.prompt_token_ids,
                                    sampling=sampling, lease_ttl_s=self.lease_ttl_s)
        last_error, any_full = None, False
        for decode in self._decode_order():
            # in flight from the pick on, so that a burst of requests spreads over the workers
            decode.in_flight += 1
            is_reserved = False
            try:
                reservation = await decode.stub.Reserve(request, timeout=timeout)
                is_reserved = True
                return decode, reservation
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    last_error = e
                    decode.is_healthy = e.code() != grpc.StatusCode.UNAVAILABLE
                    any_full |= decode.is_healthy
                    continue
                if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    await self._abort_on(decode, inp.req_id)  # it may have reserved in time
                raise self._error(e, inp) from None
            except asyncio.CancelledError:  # the worker may have reserved, unheard: undo it
                await self._abort_on(decode, inp.req_id)
                raise
            finally:
                if not is_reserved:
                    decode.in_flight -= 1
        if any_full:
            return None
        raise BackendUnavailable(f"no decode worker can take the request now: "
                                 f"{last_error.details() if last_error else 'none known'}")

    async def _prefill(self, inp: GenerateInput, sampling, decode: Worker,
                       res: pb.ReserveResponse) -> pb.PrefillResponse:
        """Prefill on the best prefill worker whose queue takes the request (a full queue
        answers RESOURCE_EXHAUSTED: the next one is asked; Overloaded when all refuse)."""
        full: list[Worker] = []
        while True:
            prefill = await self._pick_prefill(inp.prompt_token_ids, full)  # bounded wait
            try:
                return await self._prefill_on(prefill, inp, sampling, decode, res)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                full.append(prefill)

    async def _prefill_on(self, prefill: Worker, inp: GenerateInput, sampling, decode: Worker,
                          res: pb.ReserveResponse) -> pb.PrefillResponse:
        first = res.num_cached_tokens // self.block_size
        prefill.in_flight += 1
        call = prefill.stub.Prefill(pb.PrefillRequest(
            request_id=inp.req_id, prompt_token_ids=inp.prompt_token_ids, sampling=sampling,
            target=pb.KVTarget(transfer_address=res.transfer_address, lease_id=res.lease_id,
                               dst_block_ids=res.block_ids[first:], first_block=first,
                               transport=self.transport)), timeout=self._remaining(inp))
        lost: list[str] = []  # why the watcher gave up on this call

        def give_up(why: str) -> None:
            lost.append(why)
            call.cancel()

        watcher = asyncio.create_task(self._watch_lease(decode, prefill, inp.req_id,
                                                        res.lease_id, give_up))
        try:
            return await call
        except asyncio.CancelledError:
            if not lost:  # our own task is being cancelled (client gone, deadline)
                raise
            prefill.is_healthy = False
            raise WorkerLost("prefill", lost[0]) from None
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            # the prefill worker is gone, or the KV transfer failed (decode side gone, lease
            # expired): either way nothing was decoded yet and the reservation is void
            if not (e.details() or "").startswith("kv transfer failed"):
                prefill.is_healthy = False  # routing avoids it until it answers Status again
            raise WorkerLost("prefill", f"prefill worker {prefill.address}: "
                                        f"{e.details()}") from None
        finally:
            watcher.cancel()
            prefill.in_flight -= 1

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
                            f"{e.details()}")
                    return
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # that: transfer running
                    logger.warning("renewing the lease of %s on %s failed (%s): %s; retrying",
                                   req_id, decode.address, e.code().name, e.details())

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

    def _error(self, e: grpc.aio.AioRpcError, inp: GenerateInput) -> Exception:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"request {inp.req_id!r} passed its deadline")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ValueError(e.details())
        return BackendUnavailable(f"{code.name}: {e.details()}")

    async def abort(self, req_id: str) -> bool:
        running = self._running.get(req_id)
        if running is None:
            return False
        decode, worker_req_id = running
        self._aborted.add(req_id)
        with contextlib.suppress(grpc.RpcError):
            await decode.stub.Abort(pb.AbortRequestRequest(request_id=worker_req_id,
                                                           reason="aborted by the client"),
                                    timeout=5.0)
        return True

    async def status(self) -> dict[str, Any]:
        await self.refresh()
        if not any(w.is_healthy for w in self.decode) or not any(
                w.is_healthy for w in self.prefill):
            known = "; ".join(f"{role}: " + (", ".join(
                f"{w.address} {'healthy' if w.is_healthy else 'unhealthy'}" for w in ws) or "none")
                for role, ws in (("prefill", self.prefill), ("decode", self.decode)))
            raise BackendUnavailable(f"no healthy prefill or decode worker ({known})")
        pools = {"prefill": self.prefill, "decode": self.decode}
        out: dict[str, Any] = {"mode": "disaggregated", "num_streams": len(self._running),
                               "num_admission_waiting": self.num_admission_waiting,
                               "migrations": dict(self.num_migrations)}
        for key in ("num_running", "num_waiting", "num_free_blocks", "num_blocks"):
            out[key] = sum(getattr(w.status, key) for ws in pools.values() for w in ws
                           if w.status is not None)
        out["workers"] = [
            {"role": role, "address": w.address, "worker_id": w.worker_id, "epoch": w.epoch,
             "healthy": w.is_healthy,
             "in_flight": w.in_flight, "num_running": w.status.num_running if w.status else None,
             "num_waiting": w.status.num_waiting if w.status else None,
             "num_reserved": w.status.num_reserved if w.status else None,
             "num_free_blocks": w.status.num_free_blocks if w.status else None,
             "num_blocks": w.status.num_blocks if w.status else None}
            for role, ws in pools.items() for w in ws]
        drafts, accepted = _sum_lists(
            [w.status.spec_num_drafts for w in self.decode if w.status is not None]
        ), _sum_lists([w.status.spec_num_accepted for w in self.decode if w.status is not None])
        if drafts:
            out["speculative"] = {
                "num_drafts": drafts, "num_accepted": accepted,
                "acceptance_rate_per_position": [a / d if d else 0.0
                                                 for a, d in zip(accepted, drafts, strict=True)]}
        return out


def _sum_lists(lists) -> list[int]:
    """Element-wise sum of counters of different lengths (per draft position)."""
    out: list[int] = []
    for values in lists:
        for i, v in enumerate(values):
            if i == len(out):
                out.append(0)
            out[i] += int(v)
    return out
