"""Speculative decoding: cheap proposals of k tokens, verified by one target forward.

One step of a decoding request with drafts d1..dk:

    scheduler   grants k draft slots (KV blocks and token budget) next to the request's token
    proposer    fills them: n-gram prompt lookup, or a draft model run k times (spec_proposers.py)
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

Here: the verifier (`rejection_sample`) and `SpecDecoder`, which runs a proposer and the
verifier for the engine and keeps the acceptance stats; the proposers are in spec_proposers.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from engine_core.engine_config import SpeculativeConfig
from engine_core.kv_cache.layout import copy_kv_blocks
from engine_core.platforms import device_check
from engine_core.request import Request
from engine_core.sampler import Sampler, exponential_race
from engine_core.sampling_batch import SamplingBatch
from engine_core.scheduler import SchedulerOutput
from engine_core.spec_proposers import (
    DraftModelProposer,
    NgramProposer,
    drafting_batch,
    select_rows,
)
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
    return select_rows(batch, rows)


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
        batch = drafting_batch(reqs, self.vocab_size, self.eos_token_ids, dev)
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
        model, dcfg, quantization = load_model(source, engine.dtype, engine.platform,
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
