"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt position's log-probability of
the token after it, recorded as a prefill chunk computes it."""

from __future__ import annotations

import torch

PROMPT_LOGPROBS_ROWS = 64  # prompt positions per logits slice (64 x 49152 float32: 12 MiB)


def record_prompt_logprobs(logits, req, hidden: torch.Tensor, first_row: int,
                           start: int, num_new: int) -> None:
    """Append to req.prompt_logprobs the entries of this chunk's positions: the row at
    position p predicts prompt token p + 1. Raw log_softmax of dense logits (`logits(rows,
    0)`: the model runner's, no decode rows), in slices of PROMPT_LOGPROBS_ROWS rows to
    bound the [rows, vocab] memory."""
    n = req.sampling_params.prompt_logprobs
    prompt = req.prompt_token_ids
    end = min(start + num_new, req.num_prompt_tokens - 1)  # last position with a next
    # the first position not recorded yet (a preempted request recomputes from 0); the
    # scheduler gives such a request no prefix-cache hits, so no position is skipped
    assert len(req.prompt_logprobs) >= start, "prompt logprobs need every position"
    p = max(len(req.prompt_logprobs), start)
    while p < end:
        q = min(end, p + PROMPT_LOGPROBS_ROWS)
        rows = hidden[first_row + p - start : first_row + q - start]  # [q - p, hidden]
        lp = logits(rows, 0).log_softmax(dim=-1, dtype=torch.float32)  # [q - p, V]
        targets = torch.tensor(prompt[p + 1 : q + 1], dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()  # [q - p]
        top_lps, top_ids = (lp.topk(n, dim=-1) if n else (None, None))  # [q - p, n]
        for j, token in enumerate(prompt[p + 1 : q + 1]):
            entry = {token: chosen[j]}
            if n:
                for t, v in zip(top_ids[j].tolist(), top_lps[j].tolist(), strict=True):
                    entry.setdefault(t, v)
            req.prompt_logprobs.append(entry)
        p = q
