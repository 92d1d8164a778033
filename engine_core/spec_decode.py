"""Speculative decoding: cheap proposals of k tokens, verified by one target forward.

One step of a decoding request with drafts d1..dk:

    scheduler   grants k draft slots (KV blocks and token budget) next to the request's token
    proposer    fills them: n-gram prompt lookup, or a draft model run k times
    target      one forward over [t, d1..dk] at positions p..p+k; every one of these tokens is
                a decode query over the paged cache (the same kernels and quantized matmuls as
                a plain decode, so greedy output is bit-for-bit the non-speculative output)
    verifier    accepts a prefix d1..da and adds one token of its own (a correction at the
                first rejection, or a bonus token when all k pass): a + 1 tokens per step

Verification is lossless. Greedy rows accept a draft iff it is the target's argmax. Random
rows use rejection sampling: d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection the token is drawn from the residual max(0, p_i - q_i), renormalised,
which makes every emitted token distributed exactly as the target's p (q is the draft's
distribution; the n-gram proposer is deterministic, q = one-hot). p and q are the
distributions after temperature, top-k, top-p and min-p, as the sampler would draw from.

Requests that need penalties, min_tokens blocking or logprobs decode without drafts (see
Request.max_drafts); they share the batch with drafted ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor

from engine_core import device_check
from engine_core.config import SpeculativeConfig
from engine_core.kv_cache.layout import copy_kv_blocks
from engine_core.request import Request
from engine_core.sampler import Sampler, exponential_race
from engine_core.sampling_batch import SamplingBatch
from engine_core.scheduler import SchedulerOutput
from engine_core.structured_output import fill_draft_masks, unpack_masks

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Acceptance counters; position i counts drafts proposed / accepted at draft index i."""

    num_drafts: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    num_steps: int = 0  # speculative request-steps (a request verified in one step)
    num_emitted: int = 0  # tokens those steps produced (accepted drafts + 1 each)

    def add(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        k = int(num_drafts.max(initial=0))
        while len(self.num_drafts) < k:
            self.num_drafts.append(0)
            self.num_accepted.append(0)
        positions = np.arange(k)
        self.num_drafts[:k] = (np.asarray(self.num_drafts[:k])
                               + (num_drafts[:, None] > positions).sum(0)).tolist()
        self.num_accepted[:k] = (np.asarray(self.num_accepted[:k])
                                 + (num_accepted[:, None] > positions).sum(0)).tolist()
        self.num_steps += len(num_drafts)
        self.num_emitted += int(num_accepted.sum()) + len(num_drafts)

    def acceptance_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted, self.num_drafts,
                                                    strict=True)]

    def as_dict(self) -> dict:
        return {
            "num_drafts": list(self.num_drafts),
            "num_accepted": list(self.num_accepted),
            "acceptance_rate_per_position": self.acceptance_rate(),
            "mean_tokens_per_step": self.num_emitted / self.num_steps if self.num_steps else 0.0,
        }


# -- proposers ------------------------------------------------------------------------------

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
        batch = _sampling_batch(reqs, self.vocab_size, self.eos_token_ids, dev)
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
            sub = _select(batch, a)
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


def _sampling_batch(reqs: list[Request], vocab_size: int, eos_token_ids,
                    device: torch.device | str = "cpu") -> SamplingBatch:
    """The drafting requests' sampling rows (they have no penalties: Request.max_drafts)."""
    return SamplingBatch.from_requests(
        [r.sampling_params for r in reqs], [()] * len(reqs),
        [r.output_token_ids for r in reqs], [r.generator for r in reqs], vocab_size,
        eos_token_ids=eos_token_ids, device=device)


def _select(batch: SamplingBatch, rows: np.ndarray) -> SamplingBatch:
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


# -- verification ---------------------------------------------------------------------------

def rejection_sample(
    target_logits: Tensor,  # [B, K + 1, V] float32: row i predicts the token after draft i
    drafts: Tensor,  # [B, K] int64, -1 past a request's drafts
    num_drafts: Tensor,  # [B] int64
    batch: SamplingBatch,  # B rows, no penalties or blocked tokens
    draft_probs: Tensor | None = None,  # [B, K, V] the draft's q; None = deterministic drafts
) -> tuple[Tensor, Tensor]:
    """Accepted draft count a [B] and the token after them [B] (see the module docstring)."""
    num_seqs, kp1, vocab = target_logits.shape
    k = kp1 - 1
    dev = target_logits.device
    valid = torch.arange(k, device=dev) < num_drafts[:, None]  # [B, K]
    d = drafts.clamp(min=0)  # [B, K]
    greedy_ids = target_logits.argmax(dim=-1)  # [B, K + 1]
    accept = (d == greedy_ids[:, :k]) & valid  # greedy rule
    if not batch.all_greedy:
        rep = _repeat_rows(batch, kp1)
        p = Sampler.probs(target_logits.reshape(-1, vocab).clone(), rep).view(num_seqs, kp1,
                                                                             vocab)
        p_d = p[:, :k].gather(2, d[..., None]).squeeze(2)  # [B, K]
        q_d = (torch.ones_like(p_d) if draft_probs is None
               else draft_probs.gather(2, d[..., None]).squeeze(2))
        u = _uniform(num_seqs, k, batch.generators).to(dev)  # the rows' own generators
        random_accept = (u * q_d <= p_d) & valid
        accept = torch.where(batch.is_greedy[:, None], accept, random_accept)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    seq = torch.arange(num_seqs, device=dev)
    final = greedy_ids[seq, num_accepted]
    if batch.all_greedy:
        return num_accepted, final
    dist = p[seq, num_accepted]  # [B, V]: the bonus distribution when all drafts passed
    rejected = num_accepted < num_drafts
    if bool(rejected.any()):
        at = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            q = torch.zeros_like(dist).scatter_(1, d[seq, at][:, None], 1.0)
        else:
            q = draft_probs[seq, at]
        residual = (dist - q).clamp(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        # p == q leaves no residual mass (then a rejection cannot happen; keep p for safety)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), dist)
        dist = torch.where(rejected[:, None], residual, dist)
    random_final = exponential_race(dist.clone(), batch.generators)
    return num_accepted, torch.where(batch.is_greedy, final, random_final)


def _uniform(rows: int, cols: int, generators) -> Tensor:
    """[rows, cols] uniforms on the host: seeded rows from their own (host) generators."""
    with device_check.host_side():
        u = torch.rand(rows, cols)
        for row, g in enumerate(generators):
            if g is not None:
                u[row] = torch.rand(cols, generator=g)
    return u


def _repeat_rows(batch: SamplingBatch, times: int) -> SamplingBatch:
    rows = np.repeat(np.arange(batch.temperature.shape[0]), times)
    return _select(batch, rows)


class SpecDecoder:
    """The engine's speculative decoding: a proposer, the verifier and the acceptance stats."""

    def __init__(self, config: SpeculativeConfig, proposer, vocab_size: int,
                 eos_token_ids) -> None:
        self.config = config
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.stats = SpecStats()
        self._draft_probs: Tensor | None = None
        self._draft_rows: dict[str, int] = {}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write in a separate draft's cache (indexed by the target's block ids)."""
        draft_cache = getattr(self.proposer, "kv_cache", None)
        if draft_cache is not None:
            copy_kv_blocks(draft_cache, pairs)

    def propose(self, out: SchedulerOutput, rows: np.ndarray, runner) -> None:
        """Fill the step's draft slots; a request proposed fewer drafts gives back slots."""
        proposals, self._draft_probs = self.proposer.propose(out, rows, runner)
        self._draft_rows = {}
        for j, (i, drafts) in enumerate(proposals):
            req = out.reqs[i]
            req.spec_token_ids = drafts
            out.num_scheduled_tokens[i] = 1 + len(drafts)
            self._draft_rows[req.req_id] = j

    def verify(self, reqs: list[Request], logits: Tensor) -> list[list[int]]:
        """Accepted drafts + 1 token per request; logits [sum(1 + k_i), V], request-major."""
        # built on the host, then moved to the logits' device in one copy each
        num_np = np.asarray([len(r.spec_token_ids) for r in reqs], dtype=np.int64)
        kmax = int(num_np.max())
        starts = np.cumsum(num_np + 1) - (num_np + 1)  # [B]
        # [B, K + 1] rows of logits; positions past a request's drafts repeat its last row
        index = starts[:, None] + np.minimum(np.arange(kmax + 1), num_np[:, None])
        drafts_np = np.full((len(reqs), kmax), -1, dtype=np.int64)
        for b, r in enumerate(reqs):
            drafts_np[b, : len(r.spec_token_ids)] = r.spec_token_ids
        dev = logits.device
        target = logits[torch.as_tensor(index, device=dev)]  # [B, K + 1, V]
        constrained = [b for b, r in enumerate(reqs) if r.matcher is not None]
        if constrained:  # structured outputs: each position's grammar mask, drafts walked
            masks = fill_draft_masks([reqs[b].matcher for b in constrained],
                                     [reqs[b].spec_token_ids for b in constrained],
                                     kmax + 1, self.vocab_size)  # [R, K + 1, W]
            allowed = unpack_masks(masks.reshape(-1, masks.shape[-1]), self.vocab_size)
            rows = torch.tensor(constrained, dtype=torch.int64, device=dev)
            # a refused draft now has target probability 0: rejected, and the token drawn
            # in its place comes from the allowed ones
            target[rows] = target[rows].masked_fill_(
                ~allowed.to(dev).view(len(constrained), kmax + 1, -1), float("-inf"))
        num = torch.as_tensor(num_np, device=dev)
        drafts = torch.as_tensor(drafts_np, device=dev)
        batch = _sampling_batch(reqs, self.vocab_size, self.eos_token_ids, dev)
        draft_probs = None
        if self._draft_probs is not None:
            sel = torch.tensor([self._draft_rows[r.req_id] for r in reqs],
                               device=self._draft_probs.device)
            draft_probs = self._draft_probs[sel, :kmax]
        num_accepted, final = rejection_sample(target, drafts, num, batch, draft_probs)
        acc, fin = num_accepted.tolist(), final.tolist()
        self.stats.add(num_np, np.asarray(acc, dtype=np.int64))
        return [r.spec_token_ids[:a] + [f] for r, a, f in zip(reqs, acc, fin, strict=True)]


def build_spec_decoder(config: SpeculativeConfig, engine) -> SpecDecoder:
    """The proposer `config` asks for, wired to the engine's model and cache."""
    cfg = engine.model_config
    if config.method == "ngram":
        proposer = NgramProposer(config)
    elif config.draft_model is None:
        num_layers = config.draft_num_layers or max(1, cfg.num_layers // 4)
        if num_layers >= cfg.num_layers:
            raise ValueError(f"draft_num_layers must be < the target's {cfg.num_layers} "
                             f"layers, got {num_layers}")
        proposer = DraftModelProposer(engine.model, num_layers, None, None, cfg.vocab_size,
                                      engine.eos_token_ids)
        logger.info("speculative decoding: self-speculative draft of %d/%d layers, k=%d",
                    num_layers, cfg.num_layers, config.num_speculative_tokens)
    else:
        from engine_core.kv_cache.layout import KVLayout
        from engine_core.model_files import resolve_model
        from engine_core.model_loader import load_model

        source = resolve_model(config.draft_model)
        model, dcfg, quantization = load_model(source, engine.dtype, engine.device,
                                       engine.runner.quantization is not None)
        if dcfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"draft model {source.name!r} has vocab_size {dcfg.vocab_size}, "
                             f"the target has {cfg.vocab_size}: they must share a vocabulary")
        layout = KVLayout(model=source.name, dtype=engine.layout.dtype,
                          block_size=engine.layout.block_size, num_layers=dcfg.num_layers,
                          num_kv_heads=dcfg.num_kv_heads, head_dim=dcfg.head_dim)
        kv_cache = layout.allocate(engine.num_kv_blocks, engine.device)
        num_layers = (min(config.draft_num_layers, dcfg.num_layers)
                      if config.draft_num_layers else None)
        proposer = DraftModelProposer(model, num_layers, kv_cache, quantization, cfg.vocab_size,
                                      engine.eos_token_ids)
        logger.info("speculative decoding: draft model %s, k=%d", source.name,
                    config.num_speculative_tokens)
    return SpecDecoder(config, proposer, cfg.vocab_size, engine.eos_token_ids)
