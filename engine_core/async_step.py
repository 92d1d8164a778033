"""Async scheduling: the host runs one step ahead of the device (vLLM's --async-scheduling).

    step_deltas(), run ahead:
      schedule N+1           each request's token of step N (in flight) counts as pending
      launch N+1             inputs from the host, the pending tokens' ids gathered from N's
                             sampled tensor on the device; sampling queued, ids left there
      read N                 the one wait: N's ids to the host (N+1 keeps the device busy)
      update and emit N      append, stop checks, detokenize; deltas of N returned

So the schedule, input preparation and output processing of one step overlap the device's
work on the next. Nothing changes in what is computed: every step attends over the same
tokens and samples with the same state as the synchronous loop, and greedy output is the
same. What it costs: a request that ends at step N (EOS, a stop string, an abort) was
already scheduled in N+1; that token is computed and dropped, as is the one of a request
preempted meanwhile (its epoch changed).

A step runs synchronously (the step in flight read first) when it needs step N's tokens
before it can be launched, or whatever it cannot run ahead of: speculative decoding (drafts
come from the last tokens), grammar masks (a matcher consumes each token), penalties (their
counts include each token), prompt logprobs, and a KV connector (the prefill worker's
handoff acts on each step's output). `sync_reason` names it; the engine logs each reason
once and counts the steps (EngineStats).

It is on by default on CUDA, where there is a device to overlap with; on a CPU the same code
path runs (the tests do) but nothing overlaps: the forward is the host's own work.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine_core.model_runner import StepHandle
from engine_core.output_processor import record_logprobs
from engine_core.outputs import RequestDelta

if TYPE_CHECKING:
    from engine_core.engine import LLMEngine

logger = logging.getLogger(__name__)


def sync_reason(engine: LLMEngine) -> str | None:
    """Why the next step cannot run ahead, or None."""
    if engine.spec is not None:
        return "speculative decoding"
    if engine.kv_connector is not None:
        return "a KV connector"
    if engine._device_check is not None:
        return "the device check"
    sched = engine.scheduler
    for req in (*sched.running, *sched.waiting):
        p = req.sampling_params
        if req.matcher is not None or p.structured is not None:
            return "structured output"
        if p.has_penalties:
            return "penalties"
        if p.prompt_logprobs is not None:
            return "prompt logprobs"
    return None


class RunAhead:
    """The engine's step in flight (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inflight: StepHandle | None = None
        self._told: set[str] = set()

    def step(self) -> list[RequestDelta] | None:
        """One step run ahead; None when this step must run synchronously (then the step in
        flight, if any, has been read and its deltas are in `flush`)."""
        reason = sync_reason(self.engine)
        if reason is not None:
            if reason not in self._told:
                self._told.add(reason)
                logger.info("async scheduling: steps run synchronously while a request "
                            "needs it (%s)", reason)
            self.engine.stats.num_sync_steps += 1
            return None
        eng = self.engine
        t_start = time.monotonic()
        out = eng.scheduler.schedule()
        handle = None
        if not out.is_empty:
            for req in out.reqs:
                if req.times.first_scheduled is None:
                    req.times.first_scheduled = t_start
            out.num_pending = [r.num_pending for r in out.reqs]
            rows = eng.prepare(out)
            handle = eng.runner.launch(out, rows, self.inflight)
            eng.scheduler.advance(out)
            handle.epochs = [(id(r), r.num_preemptions) for r in out.reqs]
            handle.t_launch = t_start
            eng.stats.num_async_steps += 1
        else:
            eng.forget_rows(out)
        deltas = self.flush()
        self.inflight = handle
        return deltas

    def flush(self) -> list[RequestDelta]:
        """Read the step in flight and return its deltas (none in flight: none)."""
        handle, self.inflight = self.inflight, None
        if handle is None:
            return []
        eng = self.engine
        sampled, sampler_out = eng.runner.collect(handle)
        out = handle.out
        if sampler_out is not None and sampler_out[1].sampled_logprobs is not None:
            live = [(i, j) for j, i in enumerate(sampler_out[0])
                    if eng.is_live(out.reqs[i], handle.epochs[i])]
            record_logprobs(out, sampler_out[0], sampler_out[1], live)
        advanced = eng.scheduler.update_from_output(out, sampled, handle.epochs)
        eng.stats.add_step(out.total_num_tokens, sum(out.num_scheduled_tokens[out.num_decodes:]),
                           sum(map(len, sampled)), time.monotonic() - handle.t_launch)
        return eng.emit(advanced, time.monotonic())
