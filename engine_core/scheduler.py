"""The colocated engine's scheduler: a pure state machine (no torch, no I/O).

Each step it gives every running request the tokens it lacks (`num_tokens -
num_computed_tokens`: one for a decode, a chunk for a prefill) under a token budget, then admits
waiting requests while blocks and the budget last. When the pool runs dry, the most recently
admitted running request is preempted: its blocks are freed and it is recomputed later, so no
request is lost.

Forks (the n samples of one prompt, `add_request(req, fork_of=parent id)`): a child waits
until its parent's prompt KV is computed, then takes a reference on the parent's prompt blocks
(kv_cache/manager.py: the last, partial one is copied on write) and joins the waiting queue
with num_computed_tokens = prompt - 1. Its first step recomputes only the prompt's last token,
which gives it its own logits for its first token: each child samples that token itself,
through the one sampler path (its seed, penalties, grammar, logprobs), at the cost of one
token of compute. A parent that ends before its prompt is computed lets its children go as
plain requests (they prefill themselves).

Offload tiers (`tiers`, tier_loads.py): a waiting request whose prefix the pool misses asks
the tiers for more of its blocks; if they hold any it waits out of the step while they load
(WAITING_FOR_OFFLOAD), then first in line with them computed, as a fork does. A preempted
request's blocks never queued for the tiers go there before they are freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_core.engine_config import SchedulerConfig
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.tier_loads import TierLoads


@dataclass
class SchedulerOutput:
    """One step's work: requests in order, decodes (one token each) first."""

    reqs: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    finished_req_ids: list[str] = field(default_factory=list)  # since the previous step
    preempted_req_ids: list[str] = field(default_factory=list)
    # copy-on-write: (src, dst) KV block copies to run before the forward, and the requests
    # whose block tables changed in place (the runner rewrites theirs)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    rewritten_req_ids: set[str] = field(default_factory=set)
    # async scheduling (engine_core/async_step.py): each request's tokens sampled by the
    # step in flight, not known yet when this one was scheduled (empty: none anywhere)
    num_pending: list[int] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.reqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 num_spec_tokens: int = 0):
        """num_spec_tokens: draft slots a decoding request may get per step (0: no
        speculative decoding); the proposer fills them after scheduling (see spec_decode.py)."""
        self.config = config
        self.num_spec_tokens = num_spec_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}  # WAITING_FOR_KV: blocks held, KV in flight
        self.requests: dict[str, Request] = {}
        self.children: dict[str, list[Request]] = {}  # parent id -> forks waiting for its KV
        self.tiers = TierLoads(kv)  # the offload tiers' requests (tiers.offload: an engine's)
        self.loading = self.tiers.loading  # WAITING_FOR_OFFLOAD: blocks held, KV loading
        self.num_forks = 0  # children that took their parent's prompt KV
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0

    # -- requests in and out --------------------------------------------------------------
    def add_request(self, req: Request, fork_of: str | None = None) -> None:
        """Queue a request. fork_of: the id of a request with the same prompt (another
        sample of it) whose prompt KV this one shares instead of computing it; ignored when
        there is none, or when this one asks for prompt logprobs."""
        self._check_new(req)
        self.requests[req.req_id] = req
        parent = self.requests.get(fork_of) if fork_of is not None else None
        if parent is None or not _can_fork(parent, req):
            self.waiting.append(req)
        elif parent.status == RequestStatus.RUNNING and _is_prompt_computed(parent):
            self._fork(parent, [req])
        else:
            req.status = RequestStatus.WAITING_FOR_PARENT
            self.children.setdefault(parent.req_id, []).append(req)

    def _fork(self, parent: Request, children: list[Request]) -> None:
        """The children share the parent's computed prompt KV and wait (first in the queue)
        to compute its last token themselves."""
        for child in reversed(children):
            self.kv.fork(parent, child)
            child.num_computed_tokens = child.num_prompt_tokens - 1
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)
        self.num_forks += len(children)

    def _fork_children(self, parent: Request) -> None:
        """The parent's prompt KV is computed: its waiting children fork from it."""
        children = self.children.pop(parent.req_id, None)
        if children:
            self._fork(parent, children)

    def _check_new(self, req: Request) -> None:
        total = req.num_prompt_tokens + req.sampling_params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                f"({req.sampling_params.max_tokens}) must be <= max_model_len "
                f"({self.max_model_len}), got {total}"
            )
        if req.req_id in self.requests or req.req_id in self.tiers.orphans:
            raise ValueError(f"request id {req.req_id!r} is already in use")

    # -- disaggregated decode: the prompt's KV is computed elsewhere ------------------------
    def reserve(self, req: Request) -> list[int] | None:
        """Hold blocks for the whole prompt of a request whose KV a prefill worker will write.

        Returns the request's block ids (the first `req.num_cached_tokens // block_size` hold
        a prefix found in this worker's cache and need no transfer), or None when the
        sequence limit or the pool has no room; then nothing changed. Reserved requests count
        against max_num_seqs and their blocks are taken from the pool, so admission of
        running, reserved and in-flight work is one decision.
        """
        self._check_new(req)
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs:
            return None
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        if self.kv.allocate_slots(req, req.num_prompt_tokens, hit_blocks) is None:
            return None
        req.num_cached_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_KV
        self.requests[req.req_id] = req
        self.reserved[req.req_id] = req
        return self.kv.block_ids(req.req_id)

    def admit_prefilled(self, req_id: str, first_token: int) -> Request:
        """The reserved request's prompt KV is in place (verified): it joins the running batch
        with the prefill worker's first token, to be decoded next step."""
        req = self.reserved.pop(req_id)
        req.num_computed_tokens = req.num_prompt_tokens
        # its full prompt blocks now serve prefix hits; the prefill worker that computed them
        # stores them in the tiers (a second store here would take a decode step's CPU)
        self.kv.cache_computed_blocks(req, offload=False)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._fork_children(req)
        req.append_output_token(first_token)
        status = req.check_stop()
        if status is not None:
            self.running.remove(req)
            self._finish(req, status)
        return req

    def prefill_reserved(self, req_id: str, max_chunk_tokens: int) -> Request:
        """The reserved request's prompt is computed here instead of arriving from a prefill
        worker (a local prefill): it joins the running batch with its reserved blocks and
        catches num_computed_tokens up from its cached prefix, at most max_chunk_tokens per
        step, after the running decodes (local prefills share that cap per step). Its blocks
        never left the reservation, so admission counted them all along."""
        if max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        req = self.reserved.pop(req_id)
        # the last prompt token is always computed here: its logits give the first token
        req.num_computed_tokens = min(req.num_cached_tokens, req.num_prompt_tokens - 1)
        req.max_chunk_tokens = max_chunk_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (stop string, abort) requests wherever they are; unknown ids are ignored."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_KV:
                del self.reserved[req_id]
            elif req.status == RequestStatus.WAITING_FOR_OFFLOAD:
                self.tiers.abandon(req)  # its blocks are being written: kept till done
            elif req.status == RequestStatus.WAITING_FOR_PARENT:
                siblings = self.children[_parent_of(self.children, req)]
                siblings.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.req_id not in self.tiers.orphans:
            self.kv.free(req.req_id)
        req.status = status
        del self.requests[req.req_id]
        self._finished_since_step.append(req.req_id)
        for child in self.children.pop(req.req_id, ()):  # ended before its prompt was computed
            child.status = RequestStatus.WAITING
            self.waiting.append(child)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_reserved(self) -> int:
        return len(self.reserved)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step would compute something (reserved requests wait for their KV)."""
        return bool(self.running or self.waiting)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        # prompt tokens left this step for chunk-capped prefills (local prefills on a decode
        # worker): they share one cap, so however many arrive, a step's decodes wait for at
        # most that much prefill
        capped_left: int | None = None
        running, allocate = self.running, self.kv.allocate_slots
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.num_pending and (req.num_output_tokens + req.num_pending
                                    >= req.sampling_params.max_tokens):
                i += 1  # its last token is in flight: it ends when that step is read
                continue
            n = min(len(req.all_token_ids) + req.num_pending - req.num_computed_tokens, budget)
            if req.max_chunk_tokens is not None and req.num_computed_tokens < req.num_prompt_tokens:
                capped_left = req.max_chunk_tokens if capped_left is None else capped_left
                n = min(n, capped_left)
                if n == 0:  # the cap is spent: this prefill waits for the next step
                    i += 1
                    continue
                capped_left -= n
            # a decoding request may get draft slots; they are the first thing to give up
            k = (min(req.max_drafts(self.num_spec_tokens), budget - n)
                 if n == 1 and self.num_spec_tokens else 0)
            if k and allocate(req, req.num_computed_tokens + n + k) is None:
                k = 0
            while allocate(req, req.num_computed_tokens + n) is None:
                victim = running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.req_id)
                preempted = True
                if victim is req:
                    break
            else:
                req.num_lookahead_tokens = k
                scheduled.append((req, n + k))
                budget -= n + k
                i += 1

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.num_computed_tokens:  # a fork (its parent's prompt blocks), or loaded
                hit_blocks, num_hit = [], req.num_computed_tokens
            else:  # prompt logprobs: every position recomputed
                hit_blocks, num_hit = (self.kv.get_computed_blocks(req)
                                       if not req.needs_prompt_logprobs else ([], 0))
                if (self.tiers.offload is not None and not req.tiers_checked
                        and not req.needs_prompt_logprobs):
                    started = self.tiers.start(req, hit_blocks)
                    if started is None:  # no room for the blocks the tiers hold
                        if self._promote_holder():
                            continue
                        break  # wait for some
                    if started:
                        self.waiting.popleft()
                        continue
            n = min(req.num_tokens - num_hit, budget, req.max_chunk_tokens or budget)
            if self.kv.allocate_slots(req, num_hit + n, hit_blocks) is None:
                if req.num_computed_tokens and not self.running:
                    self._unfork(req)  # nothing running will free a block for it
                    continue
                if self._promote_holder():
                    continue
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        # a decode is one new token after the prompt, plus the request's draft slots; a
        # prompt's last token alone (the rest cached) is a prefill, so that it takes the same
        # path as on a cache miss
        others: list[tuple[Request, int]] = []
        for r, n in scheduled:
            if n == 1 + r.num_lookahead_tokens and r.num_computed_tokens >= len(
                    r.prompt_token_ids):
                out.reqs.append(r)
                out.num_scheduled_tokens.append(n)
            else:
                others.append((r, n))
        out.num_decodes = len(out.reqs)
        for r, n in others:
            out.reqs.append(r)
            out.num_scheduled_tokens.append(n)
        out.blocks_to_copy, out.rewritten_req_ids = self.kv.take_copies()
        return out

    def finish_load(self, req_id: str, num_loaded: int) -> None:
        """A request's load from the offload tiers is done (TierLoads.finish): it waits first
        in line with the blocks that loaded computed."""
        req = self.tiers.finish(req_id, num_loaded)
        if req is not None:
            self.waiting.appendleft(req)

    # -- async scheduling (engine_core/async_step.py; update_from_output with epochs) -------
    def advance(self, out: SchedulerOutput) -> None:
        """The step is launched, its tokens not read yet (out.num_pending: as it was
        scheduled): count its work as done and each token it samples as pending."""
        for req, n, pending in zip(out.reqs, out.num_scheduled_tokens, out.num_pending,
                                   strict=True):
            req.num_computed_tokens += n
            if req.num_computed_tokens == len(req.all_token_ids) + pending:
                req.num_pending += 1

    def _unfork(self, req: Request) -> None:
        """A waiting fork that cannot get the block it copies on write while nothing runs
        (its siblings hold the whole pool: none of them can copy) gives its shared blocks
        back and queues last as a plain request, so that a sibling can write in place."""
        self.waiting.popleft()
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.tiers_checked = False  # loaded blocks given back: the tiers still hold them
        self.waiting.append(req)

    def _promote_holder(self) -> bool:
        """The head of the queue cannot get blocks and nothing runs or loads to free any: a
        waiting request behind it that holds blocks (loaded from the tiers, or a fork) goes
        first, to run on them or give them back (_unfork), so that the pool is not left
        waiting for itself. False when there is none."""
        if self.running or self.loading:
            return False
        for i, r in enumerate(self.waiting):
            if i and r.num_computed_tokens:
                del self.waiting[i]
                self.waiting.appendleft(r)
                return True
        return False

    def _preempt(self, req: Request) -> None:
        self.tiers.swap_out(req)  # its blocks never queued for the tiers: to them now
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.num_pending = 0  # a step in flight's token for it is dropped (update_ahead)
        req.num_lookahead_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.tiers_checked = False  # its published blocks went to the tiers: look again
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_from_output(
        self, out: SchedulerOutput, sampled: list[list[int]],
        epochs: list[tuple[int, int]] | None = None,
    ) -> list[Request]:
        """Advance the scheduled requests by what the step computed and append their new
        tokens: none for an unfinished prefill chunk, one for a plain step, the accepted drafts
        and one more for a speculative step (its rejected drafts' KV is not computed). Returns
        the requests that got new tokens (finished ones included, with their status set).

        epochs (async scheduling, engine_core/async_step.py): the step was `advance`d at its
        launch, and others may have been scheduled since; each request's (id, preemptions)
        then. One that ended or was preempted since drops its token; num_computed_tokens
        stays as `advance` left it."""
        advanced = []
        finished: list[tuple[Request, RequestStatus]] = []
        cache_computed_blocks = self.kv.cache_computed_blocks
        children = self.children
        for k, (req, n, tokens) in enumerate(zip(out.reqs, out.num_scheduled_tokens, sampled,
                                                 strict=True)):
            if epochs is not None:
                if (req.status != RequestStatus.RUNNING
                        or (id(req), req.num_preemptions) != epochs[k]):
                    continue
                req.num_pending -= len(tokens)
            status = None
            if req.spec_token_ids:
                num_rejected = len(req.spec_token_ids) - max(len(tokens) - 1, 0)
                req.spec_token_ids = []
                req.num_lookahead_tokens = 0
            else:
                num_rejected = 0
            for token in tokens:
                req.append_output_token(token)
                status = req.check_stop()
                if status is not None:
                    break  # tokens after a stop are dropped
            if epochs is None:
                # (a stop among the accepted drafts leaves fewer tokens than were computed)
                req.num_computed_tokens = min(req.num_computed_tokens + n - num_rejected,
                                              len(req.all_token_ids))
            cache_computed_blocks(req)
            if children and req.req_id in children and _is_prompt_computed(req):
                self._fork_children(req)  # before the parent may finish below
            if tokens:
                advanced.append(req)
            if status is not None:
                finished.append((req, status))
        if finished:  # out of the running list in one pass, then freed in order
            done = {id(req) for req, _ in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req, status in finished:
                self._finish(req, status)
        return advanced


def _is_prompt_computed(req: Request) -> bool:
    return req.num_computed_tokens >= req.num_prompt_tokens


def _can_fork(parent: Request, child: Request) -> bool:
    """A child shares its parent's prompt KV when the prompts are one (prior output alike)
    and it needs no prompt logprobs of its own."""
    return (parent.prompt_token_ids == child.prompt_token_ids
            and parent.num_prior_output_tokens == child.num_prior_output_tokens
            and child.sampling_params.prompt_logprobs is None)


def _parent_of(children: dict[str, list[Request]], child: Request) -> str:
    return next(p for p, cs in children.items() if child in cs)
