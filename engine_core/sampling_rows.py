"""The model runner's per-row sampling parameters, kept from step to step (vLLM's InputBatch).

A request's SamplingParams are written into numpy columns once, when it gets a row; a step's
`SamplingBatch` is then a gather of its rows from each column plus small loops over the rows
that need more (min_tokens blocking, logit_bias, seeds, penalties), instead of a pass over
every request's parameters per field and step. It equals
`SamplingBatch.from_requests` of the same requests, field by field (tests/engine_core/
test_sampling_rows.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine_core.penalties import PenaltyTokens, TokenCounts
from engine_core.request import Request
from engine_core.sampling_batch import SamplingBatch
from engine_core.structured_output import unpack_masks


class SamplingRows:
    """Columns of sampling parameters by row; see the module docstring."""

    def __init__(self, max_rows: int, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.temperature = np.zeros(max_rows, np.float32)
        self.is_greedy = np.zeros(max_rows, bool)
        # greedy rows: top-k, top-p and min-p off (0, 1, 0), as from_requests normalises them
        self.top_k = np.zeros(max_rows, np.int64)
        self.top_p = np.ones(max_rows, np.float32)
        self.min_p = np.zeros(max_rows, np.float32)
        self.repetition_penalty = np.ones(max_rows, np.float32)
        self.presence_penalty = np.zeros(max_rows, np.float32)
        self.frequency_penalty = np.zeros(max_rows, np.float32)
        self.has_penalties = np.zeros(max_rows, bool)
        self.has_bias = np.zeros(max_rows, bool)
        self.min_tokens = np.zeros(max_rows, np.int64)
        self.num_prompt_tokens = np.zeros(max_rows, np.int64)  # output = tokens - these
        self.logprobs = np.full(max_rows, -1, np.int64)  # -1: none asked for
        self.generators: list[torch.Generator | None] = [None] * max_rows  # random rows'
        self.requests: list[Request | None] = [None] * max_rows

    def set_row(self, row: int, req: Request) -> None:
        p = req.sampling_params
        greedy = p.is_greedy
        self.temperature[row] = p.temperature
        self.is_greedy[row] = greedy
        self.top_k[row] = 0 if greedy or p.top_k >= self.vocab_size else max(p.top_k, 0)
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.has_penalties[row] = p.has_penalties
        self.has_bias[row] = bool(p.logit_bias)
        self.min_tokens[row] = p.min_tokens
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.generators[row] = None if greedy else req.generator
        self.requests[row] = req

    def clear_row(self, row: int) -> None:
        self.generators[row] = None
        self.requests[row] = None

    def batch(self, rows: np.ndarray, num_tokens: np.ndarray,
              token_counts: dict[int, TokenCounts], device: torch.device,
              token_masks: tuple[Sequence[int], np.ndarray] | None = None) -> SamplingBatch:
        """The SamplingBatch of `rows` (batch row i = rows[i]); num_tokens[i]: the tokens of
        row i's request so far (its output is those past its prompt)."""
        n = len(rows)
        greedy = self.is_greedy[rows]
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        no_penalties = not self.has_penalties[rows].any()
        penalty_tokens = None
        if not no_penalties:
            penalty_tokens = PenaltyTokens.from_counts(
                [token_counts.get(int(r)) for r in rows]).to(device)
        blocked: list[tuple[int, int]] = []
        for i in np.flatnonzero(num_tokens - self.num_prompt_tokens[rows] < self.min_tokens[rows]):
            p = self.requests[rows[i]].sampling_params
            blocked.extend((int(i), t) for t in sorted(p.all_stop_token_ids(self.eos_token_ids)))
        bias = [(int(i), t, b) for i in np.flatnonzero(self.has_bias[rows])
                for t, b in self.requests[rows[i]].sampling_params.logit_bias]
        logprobs = self.logprobs[rows]
        max_logprobs = int(logprobs.max()) if n and logprobs.max() >= 0 else None
        generators = self.generators
        gens = ([generators[r] for r in rows] if any(generators[r] is not None for r in rows)
                else [None] * n)

        def put(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return t.to(device)  # the array itself where the device is the host

        return SamplingBatch(
            temperature=put(self.temperature[rows]),
            is_greedy=put(greedy),
            top_p=put(top_p),
            top_k=put(top_k),
            min_p=put(min_p),
            repetition_penalty=put(self.repetition_penalty[rows]),
            presence_penalty=put(self.presence_penalty[rows]),
            frequency_penalty=put(self.frequency_penalty[rows]),
            generators=gens,
            penalty_tokens=penalty_tokens,
            blocked_token_ids=(torch.tensor(blocked, dtype=torch.int64, device=device).T
                               if blocked else None),
            bias_token_ids=(torch.tensor([(r, t) for r, t, _ in bias], dtype=torch.int64,
                                         device=device).T if bias else None),
            bias_values=(torch.tensor([b for _, _, b in bias], dtype=torch.float32,
                                      device=device) if bias else None),
            max_num_logprobs=max_logprobs,
            vocab_size=self.vocab_size,
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            no_penalties=no_penalties,
            no_top_k=not top_k.any(),
            no_top_p=bool((top_p == 1.0).all()),
            no_min_p=not min_p.any(),
            mask_rows=(torch.tensor(list(token_masks[0]), dtype=torch.int64, device=device)
                       if token_masks is not None else None),
            allowed_tokens=(unpack_masks(token_masks[1], self.vocab_size).to(device)
                            if token_masks is not None else None),
        )
