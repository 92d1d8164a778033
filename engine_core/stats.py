"""Counters the engine keeps for metrics exporters: plain numbers, updated once per step.

Nothing here knows Prometheus: the exporters (service_infra/metrics/) read these at scrape time, so
the step pays a few integer additions and one bucket search, never a per-sequence loop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# tokens computed in one step (vLLM's vllm:iteration_tokens_total buckets)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SPEED_EWMA_WEIGHT = 0.2  # weight of the newest step in the measured speeds below


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefill chunks; recompute included)
    num_generation_tokens: int = 0  # tokens sampled and kept (accepted drafts included)
    # per bucket of ITERATION_TOKENS_BUCKETS (+Inf last): steps that computed that many tokens
    iteration_tokens_counts: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    iteration_tokens_sum: int = 0
    # measured live, moving averages over steps (0.0: not measured yet). A step's time is
    # modelled as decode_step_s + num_prompt_tokens / prefill_tokens_per_s, so a step mixing
    # decode rows and a prefill chunk measures the prefill speed from what the decode rows
    # leave of it (the gateway's prefill placement reads both: gateway/disagg/prefill_policy.py)
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0  # a step of decode rows only
    # async scheduling (engine_core/async_step.py): steps run ahead, and steps that could
    # not (run synchronously while a request needed it)
    num_async_steps: int = 0
    num_sync_steps: int = 0

    def add_step(self, num_tokens: int, num_prompt_tokens: int,
                 num_generation_tokens: int, seconds: float | None = None) -> None:
        if seconds is not None and seconds > 0:
            self._measure(num_tokens - num_prompt_tokens, num_prompt_tokens, seconds)
        self.num_steps += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS,
                                                        num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens

    def _measure(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        w = SPEED_EWMA_WEIGHT
        if num_prompt_tokens == 0:
            self.decode_step_s = (seconds if self.decode_step_s == 0.0
                                  else (1 - w) * self.decode_step_s + w * seconds)
            return
        decode_part = self.decode_step_s if num_decode_tokens else 0.0
        # the decode rows' share can exceed a noisy step: the prefill keeps at least half
        speed = num_prompt_tokens / max(seconds - decode_part, seconds / 2)
        self.prefill_tokens_per_s = (speed if self.prefill_tokens_per_s == 0.0
                                     else (1 - w) * self.prefill_tokens_per_s + w * speed)
