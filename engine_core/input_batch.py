"""The model runner's rows: per running request, its token ids, its block table and its
sampling parameters, kept from step to step in numpy arrays (vLLM's InputBatch), so that a
step's inputs are a few vectorized index operations, not lists rebuilt per sequence."""

from __future__ import annotations

import numpy as np

from engine_core.penalties import TokenCounts
from engine_core.request import Request
from engine_core.sampling_rows import SamplingRows


class InputBatch:
    """Rows of token ids, block tables and sampling parameters for the requests the runner
    has seen. Invariant after `ModelRunner.sync`: a scheduled request's row holds its tokens
    so far (num_tokens) and its blocks (num_blocks); the runner writes each step's sampled
    tokens into the rows itself, so a decode step's sync finds nothing to copy."""

    def __init__(self, max_rows: int, max_model_len: int, block_size: int,
                 vocab_size: int = 1, eos_token_ids: tuple[int, ...] = ()) -> None:
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int32)
        self.num_tokens = np.zeros(max_rows, dtype=np.int32)  # valid entries of token_ids
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        # penalised requests' token counts by row, kept as tokens are appended
        self.token_counts: dict[int, TokenCounts] = {}
        self.sampling = SamplingRows(max_rows, vocab_size, eos_token_ids)

    def row(self, req: Request) -> int:
        """The request's row, created (with its tokens so far, and its penalty counts) on
        first sight: a new request, or one preempted and recomputed."""
        row = self.row_of.get(req.req_id)
        if row is None:
            row = self.free_rows.pop()
            self.row_of[req.req_id] = row
            self._fill(row, req)
            self.num_blocks[row] = 0
            self.sampling.set_row(row, req)
        return row

    def _fill(self, row: int, req: Request) -> None:
        token_ids = req.all_token_ids
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        if req.sampling_params.has_penalties:
            self.token_counts[row] = TokenCounts(*req.penalty_prompt_and_output)

    def append(self, row: int, req: Request) -> None:
        """Bring the row to the request's tokens: those it gained since the row last saw it
        (a first token from a prefill worker, accepted drafts), or, where the request lost
        tokens the row holds (never in a step's normal course), all of them again."""
        have = int(self.num_tokens[row])
        if have > req.num_tokens:
            self.token_counts.pop(row, None)
            self._fill(row, req)
            return
        new = req.all_token_ids[have:]
        self.token_ids[row, have : req.num_tokens] = new
        self.num_tokens[row] = req.num_tokens
        counts = self.token_counts.get(row)
        if counts is not None:
            counts.append(new)

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One sampled token per row, at each row's end (the step's plain samples)."""
        ends = self.num_tokens[rows]
        self.token_ids[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1
        if self.token_counts:
            for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
                counts = self.token_counts.get(row)
                if counts is not None:
                    counts.append((token,))

    def sync_blocks(self, row: int, blocks: list[int], is_rewritten: bool = False) -> None:
        """is_rewritten: blocks were replaced in place (copy-on-write), not only appended."""
        have = 0 if is_rewritten else self.num_blocks[row]
        if have != len(blocks):
            self.block_table[row, have : len(blocks)] = blocks[have:]
            self.num_blocks[row] = len(blocks)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.token_counts.pop(row, None)
            self.sampling.clear_row(row)
            self.free_rows.append(row)
