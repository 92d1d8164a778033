"""The disaggregated backend: the gateway drives each request through a decode worker's
reservation, a prefill worker's KV handoff, and the decode worker's stream.

    generate(inp):
      order decode workers (the longest prefix of the prompt each holds, as they publish it,
                                          against requests in flight from here, then most
                                          free KV blocks: gateway/disagg/routing.py rank_decode)
      D.Reserve(prompt)                -> lease + destination blocks (a prefix D caches is
                                          not sent again), asked on this gateway's output
                                          stream to D; RESOURCE_EXHAUSTED -> next D;
                                          all full -> wait for a request to end (bounded)
      local or remote? (gateway/disagg/prefill_placement.py: the cost model of prefill_policy.py
                                          over the tokens D lacks and the pools' measured
                                          speeds) local -> D.PrefillLocally(lease): D's engine
                                          prefills in the reserved blocks and streams; done
      pick prefill P (most leading prompt blocks cached there, as the Redis registry knows,
                                          against the queue from here: gateway/disagg/routing.py;
                                          equal: the prompt's first block picks one, so shared
                                          prefixes land on the same cache)
      while P runs it: D.RenewLease every lease_ttl / 3 (queues may be long; a gateway that
                                          dies stops renewing, the lease expires); a lease that
                                          ended or a P that stalled -> run it elsewhere
      P.Prefill(prompt, lease, blocks) -> KV pushed layer by layer, committed, verified;
                                          the first token
      D.Decode(first token)            -> stream of chunks to the client: sent as a start on
                                          this gateway's output stream to D, which carries
                                          every request's tokens, one message per engine step
                                          (gateway/disagg/decode_stream.py)
    Samples 1..n-1 of a prompt (fork_of) skip all of it: D.Fork on sample 0's decode worker
    shares its prompt KV there (gateway/disagg/forks.py).
    Cancellation or a deadline at any point: the pending call is cancelled (gRPC propagates it
    to the worker, which aborts) and D.Abort ends the reservation or the decode.

The backend is built of collaborators, each an object with its own state:

    pools      WorkerPools       the workers, following discovery, health from Status
                                 (gateway/disagg/worker_pools.py)
    admission  DecodeAdmission   reservations on the decode pool, and the requests waiting for
                                 room (gateway/disagg/decode_admission.py)
    handoff    PrefillHandoff    the remote prefill (gateway/disagg/prefill_handoff.py)
    placement  PrefillPlacement  local or remote (gateway/disagg/prefill_placement.py)
    forks      ForkPlacements    where parents reserved, for their forks (gateway/disagg/forks.py)
    canary_monitor  Canary       synthetic requests per pair (gateway/disagg/canary.py)

Each attempt of a request is a DisaggRequest (gateway/disagg/request.py) whose phase names how
far it got: RESERVED -> PLACED -> [PREFILLED, remote only] -> DECODING -> DONE; _run moves it
through them, one method per step, and _end releases it in whichever phase it stopped.

Timing (seconds since arrival): queue = routing and reservation + the prefill worker's queue,
prefill = its compute, kv_transfer = first token sampled -> first token delivered by D (the
un-overlapped transfer tail, verification and admission), so queue + prefill + kv_transfer =
ttft exactly. A local prefill: queue = routing, reservation and D's engine queue, prefill = D's
compute, kv_transfer = the first token's way back (no KV moves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc

from gateway.disagg.canary import Canary, CanaryConfig, CanaryVerdict, probe
from gateway.disagg.decode_admission import DecodeAdmission
from gateway.disagg.discovery import Discovery
from gateway.disagg.forks import FORK_DECISION, ForkPlacements
from gateway.disagg.prefill_handoff import PrefillHandoff
from gateway.disagg.prefill_placement import PrefillPlacement
from gateway.disagg.prefill_policy import PrefillPolicy
from gateway.disagg.request import DisaggRequest, Phase
from gateway.disagg.routing import QUEUE_WEIGHT_BLOCKS
from gateway.disagg.worker_calls import WorkerLost, abort_on, gateway_error
from gateway.disagg.worker_pools import Worker, WorkerPools
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import (
    BackendUnavailable,
    DuplicateRequestError,
    GenerateChunk,
    GenerateInput,
    ModelInfo,
    Timing,
)
from service_infra.proto_convert import (
    FINISH_REASON_NAMES,
    prompt_logprobs_from_proto,
    sampling_to_proto,
)
from service_infra.tls import TLSConfig

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 3  # a request survives two lost workers (prefill, decode or transfer)


def _continuation(inp: GenerateInput, emitted: list[int], attempt: int) -> GenerateInput | None:
    """Attempt `attempt` of a request: the first as given; a later one under its own id on the
    workers, continuing after the tokens already streamed (None: nothing left to generate).
    The continuation is prefilled afresh (a seeded request's randomness restarts with it); the
    tokens already streamed are its prior output, which the penalties keep counting."""
    if attempt == 0:
        return inp
    n, p = len(emitted), inp.params
    if n >= p.max_tokens:
        return None
    return replace(inp, req_id=f"{inp.req_id}~{attempt}", fork_of=None,
                   prompt_token_ids=[*inp.prompt_token_ids, *emitted],
                   num_prior_output_tokens=inp.num_prior_output_tokens + n,
                   params=replace(p, max_tokens=p.max_tokens - n,
                                  min_tokens=max(0, p.min_tokens - n)))


class DisaggregatedBackend:
    """The Backend interface over prefill and decode pools: builds its collaborators (the
    module docstring lists them) and drives each request through them."""

    def __init__(self, discovery: Discovery, tokenizer, transport: str = "auto",
                 lease_ttl_s: float = 30.0, model_name: str | None = None,
                 max_waiting: int = 1024, max_queue_wait_s: float = 300.0,
                 prefix_queue_weight: float = QUEUE_WEIGHT_BLOCKS,
                 tls: TLSConfig | None = None,
                 prefill_policy: PrefillPolicy | None = None,
                 canary: CanaryConfig | None = None) -> None:
        self.pools = WorkerPools(discovery, tls)
        self.admission = DecodeAdmission(self.pools, lease_ttl_s, max_waiting, max_queue_wait_s)
        self.last_success = time.monotonic()  # of a request or canary: canaries wait for idle
        # built without a config (tests over fake workers, embedding): no canary traffic
        self.canary_monitor = Canary(self, canary or CanaryConfig(idle_s=0.0))
        self.handoff = PrefillHandoff(self.pools, transport, lease_ttl_s, prefix_queue_weight,
                                      self.canary_monitor.state.bad_pairs)
        self.placement = PrefillPlacement(self.pools, self.handoff,
                                          prefill_policy or PrefillPolicy())
        self.forks = ForkPlacements()
        # several API servers (gateway/api_servers.py): the first writes its canary's
        # verdict there, the others follow it
        self.canary_verdict_out: CanaryVerdict | None = None
        self.canary_verdict_in: CanaryVerdict | None = None
        self.tokenizer = tokenizer
        self._model_name = model_name
        self.model: ModelInfo | None = None
        # client's req_id -> (its decode worker, the attempt's request id on the workers)
        self._running: dict[str, tuple[Worker, str]] = {}
        self.num_migrations = {"prefill": 0, "decode": 0}  # requests run again, by lost stage
        self._aborted: set[str] = set()  # running requests the client aborted

    @property
    def prefill(self) -> list[Worker]:
        return self.pools.prefill

    @property
    def decode(self) -> list[Worker]:
        return self.pools.decode

    @property
    def num_admission_waiting(self) -> int:
        """Requests waiting for room on the decode pool (the gateway's waiting gauge)."""
        return self.admission.num_waiting

    @property
    def num_prefill_decisions(self) -> Counter[tuple[str, str]]:
        """Prefill placements by (where, reason) (the gateway's prefill_decisions counter)."""
        return self.placement.num_decisions

    @property
    def is_ready(self) -> bool:
        """Readiness as the canary sees it (always True with the canary off); an API server
        other than the first follows the first's canary (gateway/api_servers.py)."""
        if self.canary_verdict_in is not None:
            return self.canary_verdict_in.is_ready()
        return self.canary_monitor.state.is_ready

    async def canary(self, prefill: Worker, decode: Worker, timeout_s: float) -> None:
        """One canary through the pair (gateway/disagg/canary.py's probe)."""
        await probe(self.handoff, self.tokenizer, prefill, decode, timeout_s)

    async def start(self, max_model_len: int, vocab_size: int, timeout_s: float = 120.0) -> None:
        """Wait until every worker answers and check they serve one model with one KV layout."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.pools.refresh()
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
        (model, self.pools.layout_fingerprint), = layouts
        self.pools.block_size = block_size = self.decode[0].status.block_size
        min_pool = min(w.status.num_blocks for w in self.decode) * block_size
        self.model = ModelInfo(self._model_name or model, min(max_model_len, min_pool),
                               vocab_size)
        self.pools.start_refreshing()
        self.canary_monitor.start()

    async def close(self) -> None:
        self.canary_monitor.stop()
        await self.pools.close()

    # -- the Backend interface --------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """Run the request; if a worker dies under it (prefill, decode or the KV transfer
        between them fails UNAVAILABLE), run it again elsewhere, up to MAX_ATTEMPTS: before
        its first token from scratch, after it as a continuation (prompt + the tokens already
        streamed), so the client's stream goes on. (The attempts run in this generator, not
        one of their own: every generator between the decode stream and the client costs
        each token a resume.)"""
        if inp.req_id in self._running:
            raise DuplicateRequestError(f"request_id {inp.req_id!r} is already running")
        with self.forks.as_parent(inp):
            emitted: list[int] = []  # tokens streamed to the client, all attempts
            for attempt in range(MAX_ATTEMPTS):
                winp = _continuation(inp, emitted, attempt)
                if winp is None:  # the worker died after the last token, before the finish
                    yield GenerateChunk([], "", None, "length", len(inp.prompt_token_ids),
                                        len(emitted))
                    return
                base = len(emitted)
                try:  # aclosing: a client that goes away ends the attempt (and its
                    # reservation) now
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
        """One attempt, a DisaggRequest through its phases (gateway/disagg/request.py):
        reserve, place, prefill, decode; inp.req_id is this attempt's id on the workers,
        client_id the gateway's (what abort() is called with)."""
        req = await self._reserve(inp, client_id)
        if req is None:  # aborted while it waited for its parent
            yield GenerateChunk([], "", None, "abort", len(inp.prompt_token_ids), 0)
            return
        self._running[client_id] = (req.decode, inp.req_id)
        try:
            await self._place(req)
            await self._start_decoding(req)
            try:
                async for msg in req.call:
                    yield self._output(req, msg)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and client_id not in self._aborted:
                    req.decode.is_healthy = False
                    raise WorkerLost("decode", f"decode worker {req.decode.address}: "
                                           f"{e.details()}") from None
                raise
        except (grpc.aio.AioRpcError, WorkerLost) as e:
            if client_id not in self._aborted:  # (the client's abort also ends the handoff)
                raise e if isinstance(e, WorkerLost) else gateway_error(e, inp) from None
            req.phase = Phase.DONE  # aborted before decoding began: ends like the engine's
            yield GenerateChunk([], "", None, "abort", req.num_prompt_tokens, 0)
        finally:
            await self._end(req)

    async def _reserve(self, inp: GenerateInput, client_id: str) -> DisaggRequest | None:
        """-> RESERVED: a fork on its parent's decode worker, any other request on the decode
        worker admission finds room on (its forks may follow it there). None: the client
        aborted a fork while it waited for its parent."""
        sampling = sampling_to_proto(inp.params)
        parent = await self.forks.parent_placement(inp) if inp.fork_of is not None else None
        if client_id in self._aborted:
            self._aborted.discard(client_id)
            return None
        if parent is not None:  # shares its parent's prompt KV on the parent's decode worker
            parent.decode.in_flight += 1
            return DisaggRequest(inp, client_id, sampling, parent.decode, None, parent)
        decode, reservation = await self.admission.admit(inp, sampling)  # counted in flight
        if inp.req_id == client_id:  # the first attempt: its forks may follow it there
            self.forks.placed(client_id, decode, inp.req_id)
        return DisaggRequest(inp, client_id, sampling, decode, reservation)

    async def _place(self, req: DisaggRequest) -> None:
        """RESERVED -> PLACED: local, remote, or (a fork) on its parent's KV."""
        if req.reservation is None:
            req.decision = FORK_DECISION
        else:
            req.decision, req.held = await self.placement.place(req.inp, req.decode,
                                                                req.reservation)
        req.t_placed = time.monotonic()
        req.advance(Phase.PLACED)

    async def _start_decoding(self, req: DisaggRequest) -> None:
        """PLACED -> [PREFILLED ->] DECODING: a remote prefill first, then the request's
        start on the decode worker's output stream."""
        inp, decode = req.inp, req.decode
        if req.reservation is None:
            req.call = self.forks.start(inp, req.sampling, req.parent)
        elif req.decision.where == "local":
            req.num_local_tokens = req.num_prompt_tokens - req.reservation.num_cached_tokens
            decode.num_local_tokens_in_flight += req.num_local_tokens
            req.call = decode.outputs.start(inp.req_id, inp.deadline,
                                            prefill_locally=pb.LocalPrefillRequest(
                request_id=inp.req_id, lease_id=req.reservation.lease_id,
                max_chunk_tokens=self.placement.policy.local_chunk_tokens))
        else:
            pre = await self.handoff.prefill(inp, req.sampling, decode, req.reservation,
                                             req.held)
            req.prefill_reply = pre
            req.prompt_logprobs = (prompt_logprobs_from_proto(pre.prompt_logprobs)
                                   if pre.prompt_logprobs else None)
            req.advance(Phase.PREFILLED)
            req.call = decode.outputs.start(inp.req_id, inp.deadline, decode=pb.DecodeRequest(
                request_id=inp.req_id, first_token_id=pre.first_token_id,
                first_logprob=pre.first_logprob if pre.HasField("first_logprob") else None,
                ready_timeout_s=READY_TIMEOUT_S))
        req.advance(Phase.DECODING)

    def _output(self, req: DisaggRequest, msg) -> GenerateChunk:
        """One output of the decode worker as the client's chunk; its finish -> DONE, with
        the request's timing."""
        inp, decode, pre = req.inp, req.decode, req.prefill_reply
        now = time.monotonic()
        req.t_first = req.t_first or now
        decode.num_local_tokens_in_flight -= req.num_local_tokens
        req.num_local_tokens = 0
        req.num_output_tokens += len(msg.token_ids)
        reason = FINISH_REASON_NAMES.get(msg.finish_reason)
        chunk = GenerateChunk(msg.token_ids, msg.text, msg.logprobs, reason,
                              req.num_prompt_tokens, req.num_output_tokens, msg.num_cached_tokens)
        chunk.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # on the first
        if reason is not None:
            queue_s, prefill_s = ((msg.queue_s, msg.prefill_s) if pre is None
                                  else (pre.queue_s, pre.compute_s))
            queue = (req.t_placed - inp.arrival) + queue_s
            ttft = req.t_first - inp.arrival
            chunk.timing = Timing(queue, prefill_s, ttft - queue - prefill_s,
                                  msg.first_decode_step_s, ttft, now - inp.arrival,
                                  req.decision.where, req.decision.reason)
            if reason != "abort":
                self.last_success = now
            if pre is not None:
                self.placement.learn_handoff(chunk.timing, decode, req.num_prompt_tokens
                                             - req.reservation.num_cached_tokens)
            req.advance(Phase.DONE)
        return chunk

    async def _end(self, req: DisaggRequest) -> None:
        """The attempt is over, in whatever phase: its counts released; unless DONE
        (cancelled, deadline, a failure), ended on the decode worker."""
        decode = req.decode
        decode.num_local_tokens_in_flight -= req.num_local_tokens
        self._aborted.discard(req.client_id)
        decode.in_flight -= 1
        self._running.pop(req.client_id, None)
        if req.phase is not Phase.DONE:
            if req.call is not None and not req.call.is_done:  # open on the output stream
                decode.outputs.abort(req.call, "ended at the gateway")
            else:  # a reservation, or a start that failed
                await abort_on(decode, req.inp.req_id)
        self.admission.request_ended()  # wakes the requests waiting for decode capacity

    async def abort(self, req_id: str) -> bool:
        if self.forks.is_waiting(req_id):  # ends as soon as its parent's placement is known
            self._aborted.add(req_id)
            return True
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
        await self.pools.refresh()
        if not any(w.is_healthy for w in self.decode) or not any(
                w.is_healthy for w in self.prefill):
            known = "; ".join(f"{role}: " + (", ".join(
                f"{w.address} {'healthy' if w.is_healthy else 'unhealthy'}" for w in ws) or "none")
                for role, ws in (("prefill", self.prefill), ("decode", self.decode)))
            raise BackendUnavailable(f"no healthy prefill or decode worker ({known})")
        pools = {"prefill": self.prefill, "decode": self.decode}
        out: dict[str, Any] = {"mode": "disaggregated", "num_streams": len(self._running),
                               "num_admission_waiting": self.admission.num_waiting,
                               "migrations": dict(self.num_migrations),
                               "prefill_placement": self.placement.status(),
                               "canary": self.canary_monitor.status()}
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
             "num_blocks": w.status.num_blocks if w.status else None,
             "prefill_tokens_per_s": w.status.prefill_tokens_per_s if w.status else None,
             "decode_step_s": w.status.decode_step_s if w.status else None,
             **({"kv_transfer_bytes_per_s": w.status.kv_transfer_bytes_per_s,
                 "kv_offload_load_tokens_per_s": w.status.offload_load_tokens_per_s}
                if role == "prefill" and w.status else {})}
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
