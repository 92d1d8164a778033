"""An engine stand-in for the tests of what runs an engine on its thread (ColocatedBackend,
the decode worker): no model, one token per step, milliseconds."""

from __future__ import annotations

import time
from types import SimpleNamespace

from engine_core.outputs import RequestDelta


class FakeEngine:
    """One token per step for every request (token i is i); finishes at max_tokens."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.tokenizer = object()
        self.source = SimpleNamespace(name="fake")
        self.max_model_len = 64
        self.model_config = SimpleNamespace(vocab_size=100)
        self.kv = SimpleNamespace(pool=SimpleNamespace(num_blocks=8), block_size=16,
                                  num_free_blocks=8, check_integrity=lambda: None,
                                  cache_decoded_blocks=True)  # the serving engines' default
        self.scheduler = SimpleNamespace(requests={}, num_running=0, num_waiting=0,
                                         num_preemptions=0)
        self.step_s = step_s
        self.num_steps = 0
        self.aborted: list[str] = []
        self.fail = False
        self.spec = None  # no speculative decoding
        self.offloader = None  # no KV offload tiers

    def close(self) -> None:
        pass

    def add_request(self, prompt, params, req_id, num_prior_output_tokens=0, fork_of=None):
        self.num_prior_output_tokens = num_prior_output_tokens
        self.scheduler.requests[req_id] = [params, prompt, [], time.monotonic()]
        self.scheduler.num_running = len(self.scheduler.requests)

    def abort_request(self, req_ids):
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            if self.scheduler.requests.pop(req_id, None) is not None:
                self.aborted.append(req_id)
        self.scheduler.num_running = len(self.scheduler.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def step_deltas(self) -> list[RequestDelta]:
        self.num_steps += 1
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        deltas = []
        for req_id, (params, _, out, arrival) in list(self.scheduler.requests.items()):
            out.append(len(out) + 1)
            done = len(out) >= params.max_tokens
            since = time.monotonic() - arrival
            delta = RequestDelta(req_id, [out[-1]], f"t{out[-1]} ", len(out),
                                 finish_reason="length" if done else None,
                                 is_first=len(out) == 1)
            if delta.is_first or done:
                delta.metrics = {"first_scheduled": 0.0, "first_token": since,
                                 **({"finished": since} if done else {})}
            if done:
                del self.scheduler.requests[req_id]
            deltas.append(delta)
        self.scheduler.num_running = len(self.scheduler.requests)
        return deltas
