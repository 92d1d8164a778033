"""The gateway's half of conditional prefill: once a decode worker has reserved a prompt's
blocks (and said how much of it it caches), gather what the cost model needs from the pools'
measured Status and decide local or remote (gateway/disagg/prefill_policy.py); count every decision
and learn the remote path's fixed cost from finished requests."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from gateway.disagg.prefill_handoff import PrefillHandoff, overlaps_of
from gateway.disagg.prefill_policy import (
    PrefillCosts,
    PrefillDecision,
    PrefillPolicy,
    decide,
    exposed_transfer_s,
)
from gateway.disagg.worker_pools import Worker, WorkerPools
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import GenerateInput, Timing

HANDOFF_EWMA_WEIGHT = 0.2  # of the newest remote request in the measured handoff cost


class PrefillPlacement:
    """Decides where each prompt is prefilled, from the measured Status of `pools`; a remote
    prefill's worker as `handoff` would pick it."""

    def __init__(self, pools: WorkerPools, handoff: PrefillHandoff, policy: PrefillPolicy) -> None:
        self.pools = pools
        self.handoff = handoff
        self.policy = policy
        self.num_decisions: Counter[tuple[str, str]] = Counter()  # (where, reason)
        self.last_decision: PrefillDecision | None = None
        # the remote path's cost beyond prefill compute and transfer (RPCs, commit, admission),
        # learnt from finished remote requests; 0 until the first
        self.handoff_s = 0.0

    async def place(self, inp: GenerateInput, decode: Worker, reservation: pb.ReserveResponse
                     ) -> tuple[PrefillDecision, dict[str, tuple[int, int]] | None]:
        """Local or remote, and the prefix blocks each healthy prefill worker holds (by
        address: in its pool, in its pool or offload tiers; None: unknown), which a remote
        prefill's pick reuses."""
        held = await self.prefix_held(inp.prompt_token_ids)
        if inp.params.prompt_logprobs is not None:  # only a prefill worker computes them
            decision = PrefillDecision("remote", "prompt_logprobs")
        else:
            costs = self.costs(inp, decode, reservation, held)
            decision = replace(decide(costs, self.policy),
                               num_local_tokens=costs.num_local_tokens,
                               num_remote_tokens=costs.num_remote_tokens)
        self.num_decisions[decision.where, decision.reason] += 1
        self.last_decision = decision
        return decision, held

    async def prefix_held(self, prompt: list[int]) -> dict[str, tuple[int, int]] | None:
        """The prompt's leading blocks each healthy prefill worker caches, by address: (in its
        pool, in its pool or offload tiers), from Redis or Status (WorkerPools.prefill_overlaps);
        None where unknown."""
        live = [w for w in self.pools.prefill if w.is_healthy]
        overlap = await self.pools.prefill_overlaps(prompt, live) if live else None
        return None if overlap is None else {
            w.address: n for w, n in zip(live, overlap, strict=True)}

    def costs(self, inp: GenerateInput, decode: Worker, reservation: pb.ReserveResponse,
               held: dict[str, tuple[int, int]] | None) -> PrefillCosts:
        prompt = inp.prompt_token_ids
        n_prompt = len(prompt)
        n_local = n_prompt - reservation.num_cached_tokens
        # the prefill worker routing would pick, and the prefix it caches (`held`): it
        # computes the rest (at least the last token, whose logits give the first one). It
        # lacks what the decode worker computed itself (replies' KV, local prefills), so a
        # chat's history hit there is often far shorter. Where that is unknown (Redis
        # unreachable), assume it caches what the decode worker does. What its offload tiers
        # hold beyond its pool it loads instead of computing.
        live = [w for w in self.pools.prefill if w.is_healthy]
        pairs = None if held is None else [held.get(w.address, (0, 0)) for w in live]
        pick = (self.handoff.pick_of(prompt, live, None if pairs is None
                                     else overlaps_of(live, pairs)) if live else None)
        prefill = live[pick] if pick is not None else None
        n_remote, n_load = n_local, 0
        if pairs is not None and pick is not None:
            bs = self.pools.block_size
            pool, both = pairs[pick]
            n_remote = max(1, n_prompt - both * bs)
            n_load = max(0, min(both * bs, n_prompt - 1) - pool * bs)
        ds = decode.status
        ps = prefill.status if prefill is not None else None
        measured = [w.status.prefill_tokens_per_s for w in self.pools.prefill
                    if w.status is not None and w.status.prefill_tokens_per_s > 0]
        return PrefillCosts(
            num_local_tokens=n_local,
            num_remote_tokens=n_remote,
            num_transfer_tokens=n_local,
            prefill_queue_tokens=prefill.num_tokens_in_flight if prefill is not None else 0,
            prefill_tokens_per_s=(ps.prefill_tokens_per_s if ps and ps.prefill_tokens_per_s
                                  else sum(measured) / len(measured) if measured else 0.0),
            local_tokens_per_s=ds.prefill_tokens_per_s if ds is not None else 0.0,
            # this gateway's own count is current (Status is up to a refresh old); in_flight
            # includes this request
            decode_batch=max(ds.num_running if ds is not None else 0, decode.in_flight - 1),
            decode_step_s=ds.decode_step_s if ds is not None else 0.0,
            transfer_bytes_per_s=ps.kv_transfer_bytes_per_s if ps is not None else 0.0,
            kv_bytes_per_token=ds.kv_bytes_per_token if ds is not None else 0,
            handoff_s=self.handoff_s,
            local_queue_tokens=decode.num_local_tokens_in_flight,
            num_remote_load_tokens=n_load,
            remote_load_tokens_per_s=ps.offload_load_tokens_per_s if ps is not None else 0.0)

    def _likely_prefill(self) -> Worker | None:
        """The prefill worker a remote prefill would most likely get: the shortest queue
        from here (routing may still prefer another for its prefix cache)."""
        live = [w for w in self.pools.prefill if w.is_healthy]
        return min(live, key=lambda w: w.num_tokens_in_flight, default=None)

    def learn_handoff(self, timing: Timing, decode: Worker, num_transfer_tokens: int) -> None:
        """A remote request's first token arrived: what its tail (kv_transfer_s) took beyond
        the modelled transfer (the wire time its forward did not cover) is the hop's fixed
        cost."""
        prefill = self._likely_prefill()
        speed = prefill.status.kv_transfer_bytes_per_s if prefill and prefill.status else 0.0
        per_token = decode.status.kv_bytes_per_token if decode.status else 0
        transfer = exposed_transfer_s(num_transfer_tokens * per_token, speed, timing.prefill_s)
        sample = max(0.0, timing.kv_transfer_s - transfer)
        w = HANDOFF_EWMA_WEIGHT
        self.handoff_s = sample if self.handoff_s == 0.0 else (1 - w) * self.handoff_s + w * sample

    def status(self) -> dict:
        """For /internal/status."""
        return {
            "policy": self.policy.mode,
            "local_prefill_max_tokens": self.policy.max_local_tokens,
            "local_chunk_tokens": self.policy.local_chunk_tokens,
            "handoff_s": self.handoff_s,
            "decisions": [{"where": w, "reason": r, "count": n}
                          for (w, r), n in sorted(self.num_decisions.items())],
            "last": (self.last_decision.as_dict()
                     if self.last_decision is not None else None)}
