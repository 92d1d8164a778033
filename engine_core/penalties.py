"""Repetition, frequency and presence penalties from per-request token counts.

A request with penalties keeps `TokenCounts`: its distinct tokens, how often each occurred in
its output, and whether it occurred in its prompt. The model runner builds them once when the
request gets a row (first step, or again after preemption: the row is rebuilt from the
request's tokens, as on a decode worker a migrated request arrives with its tokens) and adds
each sampled token as it is appended, so a step costs O(new tokens), not O(sequence).

The sampler applies them sparsely, to the (row, token) pairs that occurred only:

    logit  = logit / repetition if logit > 0 else logit * repetition   (prompt or output)
    logit -= frequency * output_count + presence * (output_count > 0)  (output only)

Neutral values (1, 0, 0) leave a logit bit for bit unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


class TokenCounts:
    """One request's distinct tokens: output counts and prompt membership, slot by slot."""

    def __init__(self, prompt_token_ids: Iterable[int], output_token_ids: Iterable[int] = ()
                 ) -> None:
        self._slot: dict[int, int] = {}  # token id -> slot
        self.token_ids = np.empty(64, dtype=np.int64)  # [capacity], valid up to num_tokens
        self.output_counts = np.zeros(64, dtype=np.float32)
        self.in_prompt = np.zeros(64, dtype=bool)
        self.num_tokens = 0  # distinct tokens
        for token in prompt_token_ids:
            slot = self._slot_of(token)  # first: it may grow the arrays
            self.in_prompt[slot] = True
        self.append(output_token_ids)

    def _slot_of(self, token: int) -> int:
        slot = self._slot.get(token)
        if slot is None:
            slot = self.num_tokens
            if slot == len(self.token_ids):
                grow = len(self.token_ids)
                self.token_ids = np.concatenate([self.token_ids, np.empty(grow, np.int64)])
                self.output_counts = np.concatenate([self.output_counts,
                                                     np.zeros(grow, np.float32)])
                self.in_prompt = np.concatenate([self.in_prompt, np.zeros(grow, bool)])
            self.token_ids[slot] = token
            self._slot[token] = slot
            self.num_tokens += 1
        return slot

    def append(self, output_token_ids: Iterable[int]) -> None:
        """Count tokens the request generated (in order; each exactly once)."""
        for token in output_token_ids:
            slot = self._slot_of(token)  # first: it may grow the arrays
            self.output_counts[slot] += 1


@dataclass
class PenaltyTokens:
    """The (row, token) pairs a step's penalties touch, one per distinct token of a row."""

    rows: Tensor  # [N] int64
    token_ids: Tensor  # [N] int64
    output_counts: Tensor  # [N] float32: occurrences in the output (0: prompt only)

    def to(self, device: torch.device | str) -> PenaltyTokens:
        return PenaltyTokens(self.rows.to(device), self.token_ids.to(device),
                             self.output_counts.to(device))

    @classmethod
    def from_counts(cls, counts: Sequence[TokenCounts | None]) -> PenaltyTokens:
        """Row i's pairs from counts[i] (None: a row without penalties)."""
        used = [(row, c) for row, c in enumerate(counts) if c is not None and c.num_tokens]
        if not used:
            empty = torch.empty(0, dtype=torch.int64)
            return cls(empty, empty, torch.empty(0, dtype=torch.float32))
        sizes = np.asarray([c.num_tokens for _, c in used])
        rows = np.repeat(np.asarray([row for row, _ in used], dtype=np.int64), sizes)
        return cls(
            rows=torch.from_numpy(rows),
            token_ids=torch.from_numpy(np.concatenate([c.token_ids[: c.num_tokens]
                                                       for _, c in used])),
            output_counts=torch.from_numpy(np.concatenate([c.output_counts[: c.num_tokens]
                                                           for _, c in used])),
        )


def apply_penalties(
    logits: Tensor,  # [B, V] float32, modified in place
    tokens: PenaltyTokens,
    repetition_penalty: Tensor,  # [B]
    presence_penalty: Tensor,  # [B]
    frequency_penalty: Tensor,  # [B]
) -> Tensor:
    """Penalise the logits of the tokens that occurred (see the module docstring); returns
    `logits`."""
    rows, ids, counts = tokens.rows, tokens.token_ids, tokens.output_counts
    values = logits[rows, ids]  # [N]
    rep = repetition_penalty[rows]  # [N]
    values = torch.where(values > 0, values / rep, values * rep)
    values -= frequency_penalty[rows] * counts
    values -= presence_penalty[rows] * (counts > 0)
    logits[rows, ids] = values
    return logits
