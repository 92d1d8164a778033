"""The sampler's draws follow the filtered distribution: chi-square over many draws for
top-k, top-p, min-p and their combinations, on the C kernel and on the torch path.

The row has 300 tokens whose probabilities fall off slowly, so top_p 0.9 keeps ~150 of them:
more than the kernel's 64 candidates, which it must widen past. Each case also has a negative
control, a plausible wrong reference (one token fewer, filters in the wrong order, min-p before
temperature), which the same test must reject: a test that cannot fail proves nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine_core.sampler import Sampler, draw_uniform, inverse_cdf
from engine_core.sampling_batch import SamplingBatch
from engine_core.sampling_params import SamplingParams
from tests.native_kernels import native_sampling, why_no_native_kernels

VOCAB = 300
NUM_DRAWS = 120_000
CHUNK = 20_000  # rows per sampler call
P_MIN = 1e-4  # a correct sampler fails a test 1 time in 10,000


def slow_decay_logits() -> torch.Tensor:
    """[V]: log-probabilities falling off slowly, shuffled so index order is not rank order."""
    g = torch.Generator().manual_seed(3)
    logits = -torch.linspace(0, 6, VOCAB) + 0.05 * torch.randn(VOCAB, generator=g)
    return logits[torch.randperm(VOCAB, generator=g)]


LOGITS = slow_decay_logits()


def reference(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, order="kpm") -> np.ndarray:
    """The distribution the filters define, in float64: temperature, then top-k, top-p and
    min-p in `order` (the correct one is k, p, m), renormalised."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=0)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    for step in order:
        live = torch.where(keep, probs, 0.0)
        live = live / live.sum()
        if step == "k" and top_k:
            keep &= probs >= probs.sort(descending=True).values[top_k - 1]
        elif step == "p" and top_p < 1:
            ranked, order_ = live.sort(descending=True, stable=True)
            before = ranked.cumsum(0) - ranked
            nucleus = order_[before < top_p]
            keep &= torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, nucleus, True)
        elif step == "m" and min_p:
            keep &= probs >= min_p * probs.max()
        elif step == "M" and min_p:  # wrong: min-p on the untempered probabilities
            raw = torch.softmax(LOGITS.double(), dim=0)
            keep &= raw >= min_p * raw.max()
    out = torch.where(keep, probs, 0.0)
    return (out / out.sum()).numpy()


def without_weakest(dist: np.ndarray) -> np.ndarray:
    """A wrong reference: the kept token of least probability dropped (a truncated set)."""
    wrong = dist.copy()
    kept = np.flatnonzero(wrong > 0)
    wrong[kept[np.argmin(wrong[kept])]] = 0
    return wrong / wrong.sum()


def draw_counts(params: SamplingParams, path: str) -> np.ndarray:
    """Token counts [V] of NUM_DRAWS draws, one per row, on the kernel or the torch path."""
    torch.manual_seed(1234)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for _ in range(NUM_DRAWS // CHUNK):
        batch = SamplingBatch.from_requests([params] * CHUNK, [()] * CHUNK, [()] * CHUNK,
                                            [None] * CHUNK, VOCAB, eos_token_ids=())
        logits = LOGITS.expand(CHUNK, VOCAB).clone()
        if path == "native":
            ids = Sampler(native_sampling())(logits, batch).sampled_token_ids
        else:
            ids = inverse_cdf(Sampler.probs(logits, batch), draw_uniform(batch.generators))
        counts += np.bincount(ids.numpy(), minlength=VOCAB)
    return counts


def fits(counts: np.ndarray, dist: np.ndarray) -> bool:
    """Nothing drawn outside the support, and chi-square over the support (cells expecting
    fewer than 5 draws pooled) at p >= P_MIN."""
    if counts[dist == 0].sum() > 0:
        return False
    expected = dist * counts.sum()
    support = dist > 0
    small = support & (expected < 5)
    obs = np.append(counts[support & ~small], counts[small].sum())
    exp = np.append(expected[support & ~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return True  # one token: the support check is the whole test
    return stats.chisquare(obs, exp).pvalue >= P_MIN


CASES = [  # id, params, the right reference, a wrong one
    ("top_k=40", dict(top_k=40), dict(top_k=40), "one fewer"),
    ("top_k=120", dict(top_k=120), dict(top_k=120), "one fewer"),  # past the candidates
    ("top_p=0.9", dict(top_p=0.9), dict(top_p=0.9), "one fewer"),  # ~150 tokens: widened
    ("top_p=0.3", dict(top_p=0.3), dict(top_p=0.3), "one fewer"),  # inside the candidates
    ("min_p=0.1,T=0.7", dict(min_p=0.1, temperature=0.7), dict(min_p=0.1, temperature=0.7),
     dict(min_p=0.1, temperature=0.7, order="kpM")),
    ("top_k=100,top_p=0.8", dict(top_k=100, top_p=0.8), dict(top_k=100, top_p=0.8),
     dict(top_k=100, top_p=0.8, order="pk")),
    ("T=1.5,top_k=200,top_p=0.9,min_p=0.05",
     dict(temperature=1.5, top_k=200, top_p=0.9, min_p=0.05),
     dict(temperature=1.5, top_k=200, top_p=0.9, min_p=0.05),
     dict(temperature=1.5, top_k=200, top_p=0.9, min_p=0.05, order="pkm")),
    ("T=0.5", dict(temperature=0.5), dict(temperature=0.5), dict(temperature=0.55)),
]


@pytest.fixture(params=["native", "torch"])
def path(request) -> str:
    if request.param == "native" and why_no_native_kernels() is not None:
        pytest.skip(why_no_native_kernels())
    return request.param


@pytest.mark.parametrize(("params", "right", "wrong"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_draws_follow_the_filtered_distribution(path, params, right, wrong):
    counts = draw_counts(SamplingParams(**params), path)
    dist = reference(**right)
    assert fits(counts, dist), (counts, dist)
    wrong_dist = without_weakest(dist) if wrong == "one fewer" else reference(**wrong)
    assert not np.allclose(wrong_dist, dist)  # the control differs from the truth
    assert not fits(counts, wrong_dist)  # and the test tells them apart


def test_the_references_differ_where_the_controls_need_them():
    """The order controls are only controls if the order matters for these parameters."""
    assert (reference(top_k=100, top_p=0.8) > 0).sum() != (
        reference(top_k=100, top_p=0.8, order="pk") > 0).sum()
    assert (reference(top_p=0.9) > 0).sum() > 64  # the widened case is widened
