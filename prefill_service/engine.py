"""The prefill worker's engine: an LLMEngine whose requests stop after their first token and
whose prompt KV leaves for a decode worker layer by layer, while later layers still compute.

    step k:   schedule -> [last chunk of request r?  begin r's transfer session]
              layer 0 computed -> session.send_layer(0)   (snapshot + queue; the wire is async)
              layer 1 computed -> session.send_layer(1)
              ...
              last layer handed over -> session.request_commit(): the session thread
                                        commits right behind it, the loop awaits the verdict
              first token sampled -> r finishes here

A request with a long prompt is chunked (token budget); its blocks are complete only when the
last chunk is computed, so all of its blocks are sent, layer by layer, during that last step.
With --kv-push after-forward every layer is handed over at the step's end instead, after the
first token: the baseline the overlap is measured against (benchmarks/bench_shaped_link.py).
The blocks stay in this worker's prefix cache after the request ends; the session has already
copied what it ships, so nothing waits on the transfer to reuse them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.engine import LLMEngine
from engine_core.engine_config import DeviceConfig, LoadConfig
from engine_core.kv_cache.manager import cdiv
from engine_core.scheduler import SchedulerOutput
from kv_transfer import Connection, SendSession

logger = logging.getLogger(__name__)


@dataclass
class HandoffTarget:
    """Where one request's prompt KV goes, and who hears about the outcome."""

    conn: Connection
    lease_id: str
    dst_block_ids: list[int]  # destination of prompt blocks first_block, first_block + 1, ...
    first_block: int  # prompt blocks before this one are cached on the decode worker
    # called from the engine thread once every layer has been handed to the session and its
    # commit requested (or the session could not start: then with None and the error)
    on_sent: Callable[[SendSession | None, BaseException | None], None]
    session: SendSession | None = field(default=None, repr=False)
    src_block_ids: list[int] = field(default_factory=list)  # this worker's, set per step

    def begin(self) -> bool:
        """Open the transfer session; False (and on_sent told why) if the decode side
        refused or is gone: this request fails."""
        try:
            self.session = self.conn.begin(self.lease_id, self.src_block_ids,
                                           self.dst_block_ids)
        except Exception as e:
            logger.warning("kv handoff of lease %s could not begin: %s", self.lease_id, e)
            self.on_sent(None, e)
            return False
        return True


class HandoffConnector:
    """The prefill worker's KV connector (engine_core/kv_connector.py): a request whose prompt
    KV completes in a step gets a transfer session before the model runs, and every layer is
    handed to the sessions as soon as it is computed. Targets are set from other threads."""

    def __init__(self, engine: Callable[[], LLMEngine], is_layerwise: bool = True) -> None:
        self._engine = engine  # the engine it serves (built after the connector)
        # False (--kv-push after-forward): every layer is handed over after the forward
        self.is_layerwise = is_layerwise
        self._lock = threading.Lock()
        self._targets: dict[str, HandoffTarget] = {}  # guarded by _lock

    def set_target(self, req_id: str, target: HandoffTarget) -> None:
        with self._lock:
            self._targets[req_id] = target

    def pop_target(self, req_id: str) -> HandoffTarget | None:
        with self._lock:
            return self._targets.pop(req_id, None)

    def build_step(self, out: SchedulerOutput, block_ids: list[list[int]]) -> HandoffStep | None:
        handoffs = []
        for req, n, blocks in zip(out.reqs, out.num_scheduled_tokens, block_ids, strict=True):
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # an earlier chunk: the prompt's KV is not complete after this step
            target = self.pop_target(req.req_id)
            if target is None:
                continue
            block_size = self._engine().layout.block_size
            target.src_block_ids = blocks[target.first_block:cdiv(req.num_prompt_tokens,
                                                                  block_size)]
            # after-forward: Begin waits for the forward too, or the lease would wait a
            # whole forward for its first layer (a ttl without progress expires it)
            if not self.is_layerwise or target.begin():
                handoffs.append(target)
        return HandoffStep(handoffs, self._engine().runner.kv_cache,
                           self.is_layerwise) if handoffs else None


@dataclass
class HandoffStep:
    """One step's handoffs: each layer to every session as it lands, then on_sent."""

    targets: list[HandoffTarget]
    kv_cache: object  # [num_layers, num_blocks, ...]
    is_layerwise: bool = True  # False: nothing leaves before finish()

    def save_layer(self, layer: int) -> None:
        if not self.is_layerwise:
            return
        for t in self.targets:
            t.session.send_layer(layer, self.kv_cache)  # False once the session has ended
        if layer + 1 == self.kv_cache.shape[0]:  # the KV is complete: commit behind the last
            for t in self.targets:               # layer, while the model samples
                t.session.request_commit()

    def finish(self) -> None:
        for t in self.targets:
            if not self.is_layerwise:  # the whole KV now, after the first token was sampled
                if not t.begin():
                    continue
                for layer in range(self.kv_cache.shape[0]):
                    t.session.send_layer(layer, self.kv_cache)
            t.session.request_commit()  # done already, unless the forward failed (an abort)
            t.on_sent(t.session, None)


class PrefillEngine(LLMEngine):
    """An LLMEngine with a HandoffConnector. Not thread-safe except `set_target`/`pop_target`,
    like LLMEngine."""

    def __init__(self, load_config: LoadConfig, device_config: DeviceConfig | None = None,
                 *args, kv_push: str = "layerwise", **kwargs) -> None:
        if kv_push not in ("layerwise", "after-forward"):
            raise ValueError(f"kv_push must be layerwise or after-forward, got {kv_push!r}")
        self.connector = HandoffConnector(lambda: self, is_layerwise=kv_push == "layerwise")
        # its requests end at their first token, so it runs no decode steps to capture
        device_config = dataclasses.replace(device_config or DeviceConfig(), enforce_eager=True)
        super().__init__(load_config, device_config, *args, kv_connector=self.connector,
                         **kwargs)

    def set_target(self, req_id: str, target: HandoffTarget) -> None:
        self.connector.set_target(req_id, target)

    def pop_target(self, req_id: str) -> HandoffTarget | None:
        return self.connector.pop_target(req_id)
