"""Counters the engine keeps for metrics exporters: plain numbers, updated once per step.

Nothing here knows Prometheus: the exporters (service_infra/metrics/) read these at scrape time, so
the step pays a few integer additions and one bucket search, never a per-sequence loop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# tokens computed in one step (vLLM's vllm:iteration_tokens_total buckets)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefill chunks; recompute included)
    num_generation_tokens: int = 0  # tokens sampled and kept (accepted drafts included)
    # per bucket of ITERATION_TOKENS_BUCKETS (+Inf last): steps that computed that many tokens
    iteration_tokens_counts: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    iteration_tokens_sum: int = 0

    def add_step(self, num_tokens: int, num_prompt_tokens: int,
                 num_generation_tokens: int) -> None:
        self.num_steps += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS,
                                                        num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens
