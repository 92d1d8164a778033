"""The seam through which a step's KV leaves (or, one day, arrives) while the model runs,
in the spirit of vLLM v1's KV connector: a scheduler side and a worker side.

    scheduler side   step = connector.build_step(out, block_ids)   after scheduling, before
                                                                   the model runs; None: no
                                                                   KV moves this step
    worker side      step.save_layer(i)   as layer i's KV lands in the cache (the model calls
                                          it through the ForwardContext's on_layer_done)
                     step.finish()        after the step, whatever happened

The prefill worker's connector (prefill_service/engine.py, HandoffConnector) begins a
transfer session for each request whose prompt KV completes this step, then ships every layer
as soon as it is computed. An engine without a connector moves no KV.
"""

from __future__ import annotations

from typing import Protocol

from engine_core.scheduler import SchedulerOutput


class KVConnectorStep(Protocol):
    def save_layer(self, layer: int) -> None:
        """Layer `layer`'s KV of this step is in the cache."""

    def finish(self) -> None:
        """The step is over (its forward ran, or failed)."""


class KVConnector(Protocol):
    def build_step(self, out: SchedulerOutput,
                   block_ids: list[list[int]]) -> KVConnectorStep | None:
        """What moves during this step; block_ids[i]: the blocks of out.reqs[i]."""
