"""One step's sampling parameters as tensors: `SamplingBatch`, row i = running request i.

`SamplingBatch.from_requests` builds it each step from the requests' SamplingParams, their
tokens so far and their generators; the sampler (sampler.py) reads it. Invariants:

    greedy rows    temperature < eps; top-k, top-p and min-p disabled (0, 1.0, 0.0) and no
                   generator: they never draw
    flags          the no_* / all_* flags agree with the tensors: the sampler skips a stage
                   on a flag alone
    token ids      every blocked, biased and stop token id is < vocab_size
    min_tokens     a request with fewer than min_tokens output tokens has its stop tokens
                   (EOS unless ignore_eos, plus stop_token_ids) blocked this step
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine_core.penalties import PenaltyTokens, TokenCounts
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import unpack_masks


def min_tokens_blocked_ids(
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Iterable[int],
) -> list[tuple[int, int]]:
    """(row, token) pairs to block this step: the stop tokens of every request that has
    generated fewer than `min_tokens` tokens (EOS unless `ignore_eos`, plus `stop_token_ids`)."""
    eos_token_ids = tuple(eos_token_ids)
    blocked = []
    for row, (p, num_out) in enumerate(zip(params, num_output_tokens, strict=True)):
        if num_out < p.min_tokens:
            blocked.extend((row, t) for t in sorted(p.all_stop_token_ids(eos_token_ids)))
    return blocked


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's running requests, as tensors (row i = request i).

    Build it with `from_requests`, which also sets the `no_*`/`all_*` flags that let the
    sampler skip stages; the flags must agree with the tensors.
    """

    temperature: Tensor  # [B] float32 as requested (greedy rows: < eps)
    is_greedy: Tensor  # [B] bool
    top_p: Tensor  # [B] float32; 1.0 = disabled
    top_k: Tensor  # [B] int64; 0 = disabled (-1 and k >= vocab_size normalised to 0)
    min_p: Tensor  # [B] float32; 0.0 = disabled
    repetition_penalty: Tensor  # [B] float32; 1.0 = disabled
    presence_penalty: Tensor  # [B] float32; 0.0 = disabled
    frequency_penalty: Tensor  # [B] float32; 0.0 = disabled
    # Per row; None for unseeded rows and for greedy rows (they never draw noise).
    generators: list[torch.Generator | None]
    # The (row, token) pairs the penalties touch; None when no_penalties.
    penalty_tokens: PenaltyTokens | None
    # [2, N] int64: row indices, token ids. None = nothing blocked. From a dense [B, V] bool
    # mask: `mask.nonzero().T`.
    blocked_token_ids: Tensor | None
    # logit_bias: [2, N] int64 row indices and token ids, and [N] float32 biases. None = none.
    bias_token_ids: Tensor | None
    bias_values: Tensor | None
    max_num_logprobs: int | None  # max over rows of SamplingParams.logprobs; None = no logprobs
    vocab_size: int
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    # structured outputs: the constrained rows [R] int64 and their allowed tokens [R, V] bool
    # (True = allowed). None = no row is constrained.
    mask_rows: Tensor | None = None
    allowed_tokens: Tensor | None = None

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        *,
        eos_token_ids: Iterable[int],
        device: torch.device | str = "cpu",
        token_counts: Sequence[TokenCounts | None] | None = None,
        token_masks: tuple[Sequence[int], np.ndarray] | None = None,
    ) -> SamplingBatch:
        """Batch the running requests' parameters (row i = request i).

        `output_ids` are the tokens generated so far; their count also drives min_tokens
        blocking of `eos_token_ids` and `stop_token_ids` (see `min_tokens_blocked_ids`).
        `generators[i]` must come from `make_generator(params[i].seed)` and live as long as
        the request. `token_counts[i]`, kept incrementally by the caller, are row i's penalty
        counts (None for rows without penalties); without them they are counted here from
        `prompt_ids` and `output_ids`.
        """
        num_reqs = len(params)
        assert len(prompt_ids) == len(output_ids) == len(generators) == num_reqs
        greedy = [p.is_greedy for p in params]
        # Greedy rows ignore every filter; disabling them keeps the no_* flags honest.
        top_k = [
            0 if g or p.top_k >= vocab_size else max(p.top_k, 0)
            for p, g in zip(params, greedy, strict=True)
        ]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        no_penalties = not any(p.has_penalties for p in params)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]

        def floats(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        penalty_tokens = None
        if not no_penalties:
            if token_counts is None:
                token_counts = [
                    TokenCounts(prompt if p.repetition_penalty != 1.0 else (), output)
                    if p.has_penalties else None
                    for p, prompt, output in zip(params, prompt_ids, output_ids, strict=True)
                ]
            penalty_tokens = PenaltyTokens.from_counts(token_counts).to(device)
        blocked = min_tokens_blocked_ids(params, [len(ids) for ids in output_ids], eos_token_ids)
        assert all(t < vocab_size for _, t in blocked), "stop/eos token id >= vocab_size"
        bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
        assert all(t < vocab_size for _, t, _ in bias), "logit_bias token id >= vocab_size"
        return cls(
            temperature=floats([p.temperature for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_p=floats(top_p),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            min_p=floats(min_p),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            generators=[None if g else gen for gen, g in zip(generators, greedy, strict=True)],
            penalty_tokens=penalty_tokens,
            blocked_token_ids=(
                torch.tensor(blocked, dtype=torch.int64, device=device).T if blocked else None
            ),
            bias_token_ids=(
                torch.tensor([(r, t) for r, t, _ in bias], dtype=torch.int64, device=device).T
                if bias else None
            ),
            bias_values=floats([b for _, _, b in bias]) if bias else None,
            max_num_logprobs=max(logprobs) if logprobs else None,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=no_penalties,
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(p == 1.0 for p in top_p),
            no_min_p=all(p == 0.0 for p in min_p),
            mask_rows=(torch.tensor(list(token_masks[0]), dtype=torch.int64, device=device)
                       if token_masks is not None else None),
            allowed_tokens=(unpack_masks(token_masks[1], vocab_size).to(device)
                            if token_masks is not None else None),
        )
