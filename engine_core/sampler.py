"""Batched sampling: one step's logits [B, V] in, one token per request out; the step's
sampling parameters come as a `SamplingBatch` (sampling_batch.py), row i = request i.

Pipeline, in order (each stage is skipped when no request in the batch needs it):

    raw logprobs   log_softmax of the logits as given (only if some request wants logprobs)
    logit bias     (row, token) += bias, OpenAI's logit_bias (before every other step)
    grammar mask   constrained rows: tokens their grammar does not allow set to -inf
                   (structured outputs; the bitmasks come from structured_output.py)
    penalties      repetition (prompt + output), frequency and presence (output only)
    blocked ids    (row, token) pairs set to -inf, e.g. EOS before min_tokens
    greedy         rows with temperature < eps take the argmax
    filter + draw  temperature, then top-k, top-p and min-p, then one draw per row: on CPU the
                   C kernel pd_sample (kernels/csrc/sample.c) selects candidates in one pass
                   and acts on them, widening to the whole row when the nucleus is larger;
                   elsewhere the torch reference (`Sampler.probs`) and an inverse-CDF draw

Randomness: one uniform u in [0, 1) per random row per step; the token is the first (by the
kernel's order) whose running probability exceeds u. Rows with their own `torch.Generator`
(seeded requests) draw u from it; all other rows share one batch draw from torch's default
generator. A seeded request therefore gets the same tokens whatever else is in the batch,
provided the runner keeps the request's generator across steps (it advances by one float64
per random step: `skip_draw` advances it where another process drew the token).

top-p ties: of tokens with equal probability, the lower index comes first (as argmax), so
the nucleus is the smallest prefix of (probability descending, index ascending) reaching p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine_core.penalties import apply_penalties
from engine_core.platforms import device_check
from engine_core.sampling_batch import SamplingBatch


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for `SamplingParams.seed`; None for unseeded requests.

    Create it once when the request is admitted and pass the same object every step.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def skip_draw(generator: torch.Generator) -> None:
    """Advance a seeded request's generator past one step's draw (`draw_uniform`), as when the
    prefill worker drew the request's first token from the same seed."""
    torch.rand((), dtype=torch.float64, generator=generator)


def draw_uniform(generators: Sequence[torch.Generator | None],
                 device: torch.device | str = "cpu", staged: bool = False) -> Tensor:
    """One u in [0, 1) per row [B] float64 on `device`: seeded rows from their own (host)
    generator, the others from one draw of the default generator. Drawn on the host, so a
    seeded request draws the same on any device; then (staged: a device that is not the
    host, its platform's pin_memory) one small non-blocking copy."""
    u = (torch.rand(len(generators), dtype=torch.float64).tolist()
         if any(g is None for g in generators) else [0.0] * len(generators))
    for row, generator in enumerate(generators):
        if generator is not None:
            u[row] = torch.rand((), dtype=torch.float64, generator=generator).item()
    host = torch.tensor(u, dtype=torch.float64)
    if not staged:  # the host is the device
        return host
    return host.pin_memory().to(device, non_blocking=True)  # no wait on the device's queue


@dataclass
class SamplerOutput:
    """One step's result. Logprobs are *raw*: log_softmax of the logits the model produced,
    before penalties, blocking, temperature and filtering (vLLM's default "raw_logprobs")."""

    sampled_token_ids: Tensor  # [B] int64
    # All three None when no row asked for logprobs; n = SamplingBatch.max_num_logprobs (rows
    # asking for fewer take a prefix).
    sampled_logprobs: Tensor | None  # [B] float32: logprob of the sampled token
    topk_token_ids: Tensor | None  # [B, n] int64, by descending logprob
    topk_logprobs: Tensor | None  # [B, n] float32, descending


class Sampler:
    """Picks one token per row of a [B, V] logits tensor; see the module docstring.
    kernels: the platform's sampling kernels (the CPU's C ones:
    platforms/cpu.NativeSampling), whose one-pass draw and top-1 take float32 rows in place
    of torch's ops; None: torch's. staged: the logits' device is not the host (a GPU), so
    each step's uniform draws are copied to it (draw_uniform)."""

    def __init__(self, kernels=None, staged: bool = False) -> None:
        self.kernels = kernels
        self.staged = staged

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """`logits` [B, V] are consumed: the sampler may modify them in place."""
        assert logits.dim() == 2 and logits.shape[1] == batch.vocab_size, logits.shape
        assert logits.shape[0] == batch.temperature.shape[0], (logits.shape, batch.temperature)
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # [B, V]
        logits = logits.to(torch.float32)
        if batch.bias_token_ids is not None:
            assert batch.bias_values is not None
            apply_logit_bias(logits, batch.bias_token_ids, batch.bias_values)
        if batch.mask_rows is not None:
            assert batch.allowed_tokens is not None
            apply_token_masks(logits, batch.mask_rows, batch.allowed_tokens)

        if not batch.no_penalties:
            assert batch.penalty_tokens is not None
            logits = apply_penalties(
                logits,
                batch.penalty_tokens,
                batch.repetition_penalty,
                batch.presence_penalty,
                batch.frequency_penalty,
            )
        if batch.blocked_token_ids is not None:
            apply_blocked_tokens(logits, batch.blocked_token_ids)
        sampled = self._sample(logits, batch)  # [B]

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        assert batch.max_num_logprobs is not None
        sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)  # [B]
        topk_logprobs, topk_ids = raw_logprobs.topk(batch.max_num_logprobs, dim=-1)  # [B, n]
        return SamplerOutput(sampled, sampled_logprobs, topk_ids, topk_logprobs)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.all_greedy:
            return argmax_rows(logits, self.kernels)
        u = draw_uniform(batch.generators, logits.device, self.staged)  # [B]
        temperature = batch.temperature  # greedy rows: 0, the kernel's argmax
        if not batch.all_random:
            temperature = temperature.masked_fill(batch.is_greedy, 0.0)
        if self.kernels is not None and logits.dtype == torch.float32:
            return self.kernels.sample(logits.contiguous(), temperature, batch.top_k,
                                       batch.top_p, batch.min_p, u)
        greedy_ids = None if batch.all_random else logits.argmax(dim=-1)  # [B]
        random_ids = inverse_cdf(Sampler.probs(logits, batch), u)
        if greedy_ids is None:
            return random_ids
        return torch.where(batch.is_greedy, greedy_ids, random_ids)

    @staticmethod
    def probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
        """The distribution random rows sample from: temperature, then top-k/top-p and min-p
        filtering, softmax. [B, V] float32; greedy rows get a T = 1 distribution (ignore it).
        `logits` (float32, penalties already applied) are modified in place."""
        # Greedy rows get T = 1 so the division stays finite; their row result is discarded.
        temperature = batch.temperature
        if not batch.all_random:
            temperature = temperature.masked_fill(batch.is_greedy, 1.0)
        logits.div_(temperature.unsqueeze(1))
        if not (batch.no_top_k and batch.no_top_p):
            logits = apply_top_k_top_p(
                logits,
                None if batch.no_top_k else batch.top_k,
                None if batch.no_top_p else batch.top_p,
            )
        if not batch.no_min_p:
            apply_min_p(logits, batch.min_p)
        return logits.softmax(dim=-1)


def apply_logit_bias(logits: Tensor, token_ids: Tensor, values: Tensor) -> None:
    """In place: logits[row, token] += bias for each column (row, token) of [2, N] pairs and
    its bias in values [N]."""
    logits.index_put_((token_ids[0], token_ids[1]), values, accumulate=True)


def apply_token_masks(logits: Tensor, rows: Tensor, allowed: Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where allowed[i, t] is False ([R] rows, [R, V])."""
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))


def apply_blocked_tokens(logits: Tensor, blocked_token_ids: Tensor) -> None:
    """Set logits[row, token] = -inf in place for each column (row, token) of [2, N] pairs."""
    logits[blocked_token_ids[0], blocked_token_ids[1]] = float("-inf")


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k and then its top-p nucleus.

    top_k [B] int64 (0 = keep all): keep tokens whose logit is >= the k-th largest (ties at the
    boundary are kept). top_p [B] in (0, 1]: keep the smallest prefix of the tokens, by
    probability (renormalised after top-k) descending and equal ones by index, whose mass
    reaches p; the most likely token always stays. One stable descending sort serves both;
    top-k alone needs only a partial `topk`. The torch reference of pd_sample's filters.
    Returns the masked logits (possibly `logits` itself, modified in place).
    """
    vocab_size = logits.shape[1]
    if top_p is None:
        assert top_k is not None
        return _apply_top_k_only(logits, top_k)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [B]
        kth_largest = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [B, V], descending
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]: of the tokens ahead of each
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)  # p = 1: rounding
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_top_k_only(logits: Tensor, top_k: Tensor) -> Tensor:
    """Top-k without a full sort: the k-th largest logit from `topk(max k)`, in place."""
    disabled = top_k <= 0  # [B]
    k = top_k.masked_fill(disabled, 1).clamp(max=logits.shape[1])  # [B]
    top_values = logits.topk(int(k.max()), dim=-1).values  # [B, max_k], descending
    kth_largest = top_values.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    kth_largest.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth_largest, float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor) -> None:
    """In place: mask tokens whose probability is below min_p [B] times the row's max."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def exponential_race(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Sample one token per row of probs [B, V] as argmax(probs / q), q ~ Exponential(1).

    This equals sampling from `probs` (the first of V exponential clocks with rates p_i to
    ring), and lets each seeded row draw its q from its own generator.
    """
    seeded = [(row, g) for row, g in enumerate(generators) if g is not None]
    q = torch.empty_like(probs)  # [B, V]
    if len(seeded) < probs.shape[0]:
        q.exponential_()  # unseeded rows: one draw from the default generator
    for row, generator in seeded:  # drawn where the generator lives (the host), then moved
        with device_check.host_side():
            drawn = torch.empty(q.shape[1], dtype=q.dtype).exponential_(generator=generator)
        q[row].copy_(drawn)
    # q == 0 is possible; clamping keeps 0 / q at 0 instead of NaN (which argmax would pick).
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Per row of probs [B, V] (unnormalised, >= 0), the first token whose running mass
    exceeds u [B] times the row's mass: a draw from the row. Zero-mass tokens are never
    drawn."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    total = cdf[:, -1]  # [B]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def argmax_rows(logits: Tensor, kernels=None) -> Tensor:
    """Each row's argmax, the lowest index among equal maxima (as torch's), with the
    platform's sampling kernels where they take the rows (Sampler)."""
    if kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2:
        return kernels.argmax(logits)
    return logits.argmax(dim=-1)
