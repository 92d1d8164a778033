"""Speculative decoding's proposers: up to k draft tokens per decoding request, for the draft
slots the scheduler granted (spec_decode.py calls them, then verifies the drafts).

    NgramProposer        prompt lookup (`ngram_lookup`): the tokens that followed the latest
                         earlier occurrence of the sequence's last n tokens; deterministic
                         (q = one-hot), so no draft probabilities
    DraftModelProposer   a small model, or the target's first layers, run k times; returns the
                         distributions q [B, k, V] it drew the drafts from (None when every
                         row is greedy)

`propose(out, rows, runner)` returns [(index into out.reqs, draft tokens)] and those
probabilities. Drafting requests have no penalties, min_tokens blocking, logit bias or logprobs
(Request.max_drafts), so their sampling rows (`drafting_batch`, `select_rows`) hold temperature
and the filters alone: the draft's q here and the verifier's p come from the same rows.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor

from engine_core.engine_config import SpeculativeConfig
from engine_core.request import Request
from engine_core.sampler import Sampler, exponential_race
from engine_core.sampling_batch import SamplingBatch
from engine_core.scheduler import SchedulerOutput


def ngram_lookup(tokens: np.ndarray, lens: np.ndarray, k: np.ndarray, ngram_min: int,
                 ngram_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lookup for a batch of sequences, vectorized over sequences.

    tokens [B, L] (row b valid up to lens[b]); k [B] drafts wanted. For n = ngram_max down
    to ngram_min, find the latest earlier occurrence of each sequence's last n tokens that is
    followed by at least one token; propose up to k[b] tokens that followed it. Returns drafts
    [B, max k] (-1 padded) and their counts [B].
    """
    num_seqs = tokens.shape[0]
    kmax = int(k.max(initial=0))
    drafts = np.full((num_seqs, max(kmax, 1)), -1, dtype=np.int64)
    counts = np.zeros(num_seqs, dtype=np.int64)
    found = np.zeros(num_seqs, dtype=bool)
    seq = np.arange(num_seqs)
    for n in range(ngram_max, ngram_min - 1, -1):
        todo = ~found & (lens > n) & (k > 0)
        if not todo.any() or tokens.shape[1] <= n:
            continue
        windows = sliding_window_view(tokens, n, axis=1)  # [B, L - n + 1, n]
        suffix = tokens[seq[:, None], np.clip(lens[:, None] - n + np.arange(n), 0, None)]
        match = (windows == suffix[:, None, :]).all(axis=2)  # [B, L - n + 1]
        starts = np.arange(windows.shape[1])
        match &= starts[None, :] < (lens - n)[:, None]  # a token follows; not the suffix
        match &= todo[:, None]
        hit = match.any(axis=1)
        latest = windows.shape[1] - 1 - match[:, ::-1].argmax(axis=1)  # [B]
        follow = latest + n  # first proposed position
        num = np.minimum(k, lens - follow)
        cols = np.arange(drafts.shape[1])
        take = hit[:, None] & (cols[None, :] < num[:, None])
        src = np.clip(follow[:, None] + cols[None, :], 0, tokens.shape[1] - 1)
        drafts = np.where(take, tokens[seq[:, None], src], drafts)
        counts = np.where(hit, num, counts)
        found |= hit
    return drafts, counts


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, out: SchedulerOutput, rows: np.ndarray, runner) -> tuple[list, None]:
        idx = [i for i in range(out.num_decodes) if out.reqs[i].num_lookahead_tokens]
        if not idx:
            return [], None
        reqs = [out.reqs[i] for i in idx]
        lens = np.asarray([r.num_tokens for r in reqs], dtype=np.int64)
        tokens = runner.batch.token_ids[rows[idx], : int(lens.max())]
        k = np.asarray([r.num_lookahead_tokens for r in reqs], dtype=np.int64)
        drafts, counts = ngram_lookup(tokens, lens, k, self.config.ngram_min,
                                      self.config.ngram_max)
        return [(i, drafts[j, : counts[j]].tolist()) for j, i in enumerate(idx)], None


class DraftModelProposer:
    """k autoregressive steps of a small model over the step's decoding requests.

    The draft's KV lives in its own paged cache indexed by the target's block ids (the
    scheduler allocated slots for the drafts), or, for a self-speculative draft (the target's
    first layers), in the target's own cache: its layers' KV is exactly what the target
    computes, so it needs no prefill of its own. A separate draft catches up on the tokens it
    has not seen (the whole prompt the first time) in its first step.
    """

    def __init__(self, model, num_layers: int | None, kv_cache: Tensor | None,
                 quantization, vocab_size: int, eos_token_ids) -> None:
        self.model = model
        self.num_layers = num_layers
        self.kv_cache = kv_cache  # None: the target's cache
        self.quantization = quantization  # a separate draft's own; None: the target's
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_seen: dict[str, int] = {}  # separate cache: positions with valid draft KV

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.num_seen.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, rows: np.ndarray, runner) -> tuple[list, Tensor]:
        self.forget(out.finished_req_ids + out.preempted_req_ids)
        idx = [i for i in range(out.num_decodes) if out.reqs[i].num_lookahead_tokens]
        if not idx:
            return [], None
        reqs = [out.reqs[i] for i in idx]
        k = np.asarray([r.num_lookahead_tokens for r in reqs], dtype=np.int64)
        num_tokens = np.asarray([r.num_tokens for r in reqs], dtype=np.int64)
        if self.kv_cache is None:
            start = num_tokens - 1
        else:
            start = np.asarray([min(self.num_seen.get(r.req_id, 0), r.num_computed_tokens)
                                for r in reqs], dtype=np.int64)
        dev = runner.device
        batch = drafting_batch(reqs, self.vocab_size, self.eos_token_ids, dev)
        sel_rows = rows[idx]
        drafts = np.full((len(reqs), int(k.max())), -1, dtype=np.int64)
        probs = None if batch.all_greedy else torch.zeros(len(reqs), drafts.shape[1],
                                                          self.vocab_size, device=dev)
        active = np.arange(len(reqs))
        num_new = num_tokens - start  # first step: catch up to (and including) the last token
        for j in range(drafts.shape[1]):
            # decodes (one token) must lead the batch: order the catch-up chunks after them
            a = active[np.argsort(num_new[active] > 1, kind="stable")]
            nd = int((num_new[a] == 1).sum())
            input_ids, positions, meta, cu = runner.build_inputs(
                sel_rows[a], start[a], num_new[a], nd)
            ndt = int(cu[nd - 1]) if nd else 0
            hidden = self._forward(runner, input_ids, positions, meta, ndt)
            logits = self._logits(runner, hidden[torch.as_tensor(cu - 1, device=dev)], nd)
            sub = select_rows(batch, a)
            greedy = logits.argmax(dim=-1)
            if sub.all_greedy:
                tokens = greedy
            else:
                p = Sampler.probs(logits.clone(), sub)
                tokens = torch.where(sub.is_greedy, greedy, exponential_race(p.clone(),
                                                                             sub.generators))
                probs[torch.as_tensor(a, device=dev), j] = p
            tok = np.asarray(tokens.tolist(), dtype=np.int64)
            drafts[a, j] = tok
            pos = num_tokens[a] + j  # where draft j sits in the sequence
            runner.batch.token_ids[sel_rows[a], pos] = tok
            start[a] = pos
            num_new[:] = 1
            keep = k[a] > j + 1
            active = np.sort(a[keep])
            if len(active) == 0:
                break
        if self.kv_cache is not None:
            for r, kk, n in zip(reqs, k, num_tokens, strict=True):
                self.num_seen[r.req_id] = int(n - 1 + kk)  # KV of [.. t, d1 .. d(k-1)]
        return [(i, drafts[j, : k[j]].tolist()) for j, i in enumerate(idx)], probs

    def _forward(self, runner, input_ids, positions, meta, num_quant_rows):
        return runner.forward(input_ids, positions, meta, num_quant_rows,
                              kv_cache=self.kv_cache, model=self.model,
                              num_layers=self.num_layers, quantization=self.quantization)

    def _logits(self, runner, hidden, num_quant_rows):
        return runner.logits(hidden, num_quant_rows, model=self.model,
                             quantization=self.quantization)


def drafting_batch(reqs: list[Request], vocab_size: int, eos_token_ids,
                   device: torch.device | str = "cpu") -> SamplingBatch:
    """The drafting requests' sampling rows (they have no penalties: Request.max_drafts)."""
    return SamplingBatch.from_requests(
        [r.sampling_params for r in reqs], [()] * len(reqs),
        [r.output_token_ids for r in reqs], [r.generator for r in reqs], vocab_size,
        eos_token_ids=eos_token_ids, device=device)


def select_rows(batch: SamplingBatch, rows: np.ndarray) -> SamplingBatch:
    """The batch's rows `rows` (no penalties, blocked tokens or logit bias: drafting requests
    have none)."""
    r = torch.as_tensor(rows, dtype=torch.int64, device=batch.temperature.device)
    greedy = batch.is_greedy[r]
    return SamplingBatch(
        temperature=batch.temperature[r], is_greedy=greedy, top_p=batch.top_p[r],
        top_k=batch.top_k[r], min_p=batch.min_p[r],
        repetition_penalty=batch.repetition_penalty[r],
        presence_penalty=batch.presence_penalty[r], frequency_penalty=batch.frequency_penalty[r],
        generators=[batch.generators[i] for i in rows.tolist()], penalty_tokens=None,
        blocked_token_ids=None, bias_token_ids=None, bias_values=None, max_num_logprobs=None,
        vocab_size=batch.vocab_size, all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()), no_penalties=True,
        no_top_k=bool((batch.top_k[r] == 0).all()), no_top_p=bool((batch.top_p[r] == 1).all()),
        no_min_p=bool((batch.min_p[r] == 0).all()),
    )
