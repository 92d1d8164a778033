"""Sampler: greedy and filters exactly, distributions statistically, seeds reproducibly."""

from __future__ import annotations

import math

import pytest
import torch

from engine_core.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from engine_core.sampling_batch import SamplingBatch, min_tokens_blocked_ids
from engine_core.sampling_params import SamplingParams
from tests.native_kernels import native_sampling

EOS = 0
# Chi-square critical values at significance 0.001, by degrees of freedom.
CHI2_CRITICAL_0_001 = {2: 13.816, 3: 16.266, 7: 24.322}
NUM_DRAWS = 20_000

# A known 8-token distribution with clear gaps between the cumulative masses.
PROBS_8 = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
LOGITS_8 = PROBS_8.log()

# the sampler an engine on this CPU builds: the C kernels where they load, else torch's
SAMPLER = Sampler(native_sampling())


def make_batch(
    params: list[SamplingParams],
    vocab_size: int,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.from_requests(
        params,
        prompt_ids if prompt_ids is not None else [[1]] * n,
        output_ids if output_ids is not None else [[]] * n,
        generators if generators is not None else [make_generator(p.seed) for p in params],
        vocab_size,
        eos_token_ids=[EOS],
    )


def random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=g) * 3


def sample_many(params: SamplingParams, logits_row: torch.Tensor) -> torch.Tensor:
    """Token counts [V] of NUM_DRAWS independent draws (one row each, unseeded)."""
    torch.manual_seed(1234)
    vocab_size = logits_row.shape[0]
    batch = make_batch([params] * NUM_DRAWS, vocab_size)
    logits = logits_row.expand(NUM_DRAWS, vocab_size).clone()
    ids = SAMPLER(logits, batch).sampled_token_ids
    return torch.bincount(ids, minlength=vocab_size).double()


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit over the tokens with non-zero probability; the rest must
    never be drawn."""
    probs = probs.double() / probs.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, counts
    expected = probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum().item()
    dof = int(support.sum()) - 1
    assert statistic < CHI2_CRITICAL_0_001[dof], (statistic, counts / counts.sum(), probs)


# ---------------------------------------------------------------- exact paths


def test_greedy_is_argmax() -> None:
    logits = random_logits(16, 100)
    expected = logits.argmax(dim=-1)
    batch = make_batch([SamplingParams(temperature=0.0)] * 16, 100)
    assert batch.all_greedy
    out = SAMPLER(logits.clone(), batch)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.sampled_logprobs is None and out.topk_token_ids is None


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = random_logits(8, 100)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.5) for i in range(8)]
    batch = make_batch(params, 100)
    assert not batch.all_greedy and not batch.all_random
    out = SAMPLER(logits.clone(), batch).sampled_token_ids
    assert torch.equal(out[1::2], logits.argmax(dim=-1)[1::2])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.3, min_p=0.5),
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "combined"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(64, 500)
    out = SAMPLER(logits.clone(), make_batch([params] * 64, 500)).sampled_token_ids
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_top_p_masks() -> None:
    logits = torch.stack([LOGITS_8, LOGITS_8, LOGITS_8, LOGITS_8.flip(0)])
    top_k = torch.tensor([3, 0, 4, 2])
    top_p = torch.tensor([1.0, 0.75, 0.75, 1.0])
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p)
    kept = masked.isfinite()
    # row 0: top-3; row 1: 0.4+0.25+0.15 = 0.8 >= 0.75; row 2: top-4 renormalised
    # (0.4, 0.25, 0.15, 0.1) / 0.9, of which 0.444 + 0.278 < 0.75 <= + 0.167; row 3: reversed.
    assert kept.tolist() == [
        [True] * 3 + [False] * 5,
        [True] * 3 + [False] * 5,
        [True] * 3 + [False] * 5,
        [False] * 6 + [True] * 2,
    ]
    assert torch.equal(masked[kept], logits[kept])  # kept logits untouched


def test_top_k_keeps_ties_and_at_least_one_token() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([1, 2]), torch.tensor([1e-9, 1e-9]))
    # top-k keeps both tied 3.0s, then a tiny top-p keeps exactly one token per row.
    assert masked.isfinite().sum(dim=-1).tolist() == [1, 1]


def test_top_k_only_path_matches_sort_path() -> None:
    logits = random_logits(6, 300)
    top_k = torch.tensor([0, 1, 7, 50, 299, 1000])
    partial = apply_top_k_top_p(logits.clone(), top_k, None)  # topk, no sort
    full = apply_top_k_top_p(logits.clone(), top_k, torch.ones(6))  # sort; p = 1 keeps all
    assert torch.equal(partial, full)
    assert partial.isfinite().sum(dim=-1).tolist() == [300, 1, 7, 50, 299, 300]


def test_min_p_masks_relative_to_max() -> None:
    logits = LOGITS_8.repeat(2, 1)
    apply_min_p(logits, torch.tensor([0.3, 0.0]))  # row 0 threshold 0.12
    assert logits[0].isfinite().tolist() == [True] * 3 + [False] * 5
    assert logits[1].isfinite().all()


def test_penalties_exact_values() -> None:
    vocab_size = 6
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -0.5, 1.0],
            [2.0, -1.0, 0.5, 3.0, -0.5, 1.0],
            [0.3, -0.7, 0.1, 1.7, -0.2, 0.9],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0),  # no repetition penalty: prompt irrelevant
        SamplingParams(),
    ]
    batch = make_batch(
        params, vocab_size, prompt_ids=[[0, 4], [0], [3]], output_ids=[[1, 1, 2], [5], [3]]
    )
    assert not batch.no_penalties
    assert batch.penalty_tokens is not None
    out = apply_penalties(
        logits.clone(),
        batch.penalty_tokens,
        batch.repetition_penalty,
        batch.presence_penalty,
        batch.frequency_penalty,
    )
    # row 0: tok0 (prompt, >0) 2/2; tok1 (output x2, <0) -1*2 - 0.25*2 - 0.5;
    # tok2 (output x1, >0) 0.5/2 - 0.25 - 0.5; tok4 (prompt, <0) -0.5*2.
    assert out[0].tolist() == [1.0, -3.0, -0.5, 3.0, -1.0, 1.0]
    assert out[1].tolist() == [2.0, -1.0, 0.5, 3.0, -0.5, 2.0]
    assert torch.equal(out[2], logits[2])


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.2)]
    out = SAMPLER(logits, make_batch(params, 4, output_ids=[[1]])).sampled_token_ids
    assert out.tolist() == [2]


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    vocab_size = 5
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0, 0.0]]).repeat(4, 1)  # EOS (0) is the argmax
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    output_ids = [[4], [4], [4], [4, 4]]  # the last row has reached min_tokens
    assert min_tokens_blocked_ids(params, [len(o) for o in output_ids], [EOS]) == [
        (0, 0),
        (1, 0),
        (1, 2),
        (2, 2),
    ]
    batch = make_batch(params, vocab_size, output_ids=output_ids)
    out = SAMPLER(logits, batch).sampled_token_ids
    assert out.tolist() == [2, 3, 0, 0]


# ---------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.8])
def test_temperature_distribution(temperature: float) -> None:
    counts = sample_many(SamplingParams(temperature=temperature), LOGITS_8)
    assert_matches(counts, torch.softmax(LOGITS_8.double() / temperature, dim=-1))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(top_k=4), PROBS_8[:4]),
        (SamplingParams(top_p=0.75), PROBS_8[:3]),  # 0.4 + 0.25 + 0.15 >= 0.75
        (SamplingParams(min_p=0.3), PROBS_8[:3]),  # >= 0.3 * 0.4
        (SamplingParams(top_k=3, temperature=0.5), torch.softmax(LOGITS_8[:3] / 0.5, dim=-1)),
    ],
    ids=["top_k=4", "top_p=0.75", "min_p=0.3", "top_k=3,T=0.5"],
)
def test_filtered_distribution_is_renormalised(
    params: SamplingParams, expected: torch.Tensor
) -> None:
    counts = sample_many(params, LOGITS_8)
    padded = torch.zeros(8, dtype=torch.float64)
    padded[: expected.shape[0]] = expected
    assert_matches(counts, padded)


# ---------------------------------------------------------------- seeds


SEEDED = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=200)


def run_steps(
    params: list[SamplingParams], row: int, num_steps: int = 6, vocab_size: int = 1000
) -> list[int]:
    """Tokens of `params[row]` over `num_steps` steps, each step with fresh logits that are
    the same for that row whatever the batch."""
    generators = [make_generator(p.seed) for p in params]
    tokens = []
    for step in range(num_steps):
        logits = random_logits(len(params), vocab_size, seed=100 + step) / 3
        logits[row] = random_logits(1, vocab_size, seed=step)[0] / 3
        batch = make_batch(params, vocab_size, generators=generators)
        tokens.append(SAMPLER(logits, batch).sampled_token_ids[row].item())
    return tokens


def test_seeded_request_is_reproducible() -> None:
    first = run_steps([SEEDED], 0)
    assert run_steps([SEEDED], 0) == first
    assert len(set(first)) > 1  # the generator advances between steps
    other_seed = SamplingParams(seed=99, temperature=0.9, top_p=0.95, top_k=200)
    assert run_steps([other_seed], 0) != first


def test_seeded_request_is_batch_independent() -> None:
    alone = run_steps([SEEDED], 0)
    torch.manual_seed(7)  # the shared batch draw changes; the seeded row must not
    mixed = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SEEDED,
        SamplingParams(seed=5, top_k=3),
        SamplingParams(repetition_penalty=1.3, logprobs=2),
    ]
    assert run_steps(mixed, 2) == alone
    all_seeded = [SamplingParams(seed=5), SEEDED]  # no shared batch draw at all
    assert run_steps(all_seeded, 1) == alone


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_sorted() -> None:
    vocab_size = 50
    raw = random_logits(3, vocab_size)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5, top_k=10),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(logprobs=0, min_p=0.1),
    ]
    batch = make_batch(params, vocab_size, output_ids=[[3, 3], [7], []])
    assert batch.max_num_logprobs == 5
    out = SAMPLER(raw.clone(), batch)
    expected = torch.log_softmax(raw, dim=-1)
    ids = out.sampled_token_ids
    assert out.sampled_logprobs is not None and out.sampled_logprobs.dtype == torch.float32
    assert torch.allclose(out.sampled_logprobs, expected[torch.arange(3), ids], rtol=0, atol=1e-6)
    assert out.topk_logprobs is not None and out.topk_token_ids is not None
    assert out.topk_logprobs.shape == out.topk_token_ids.shape == (3, 5)
    assert (out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all()
    assert torch.allclose(
        out.topk_logprobs, expected.gather(1, out.topk_token_ids), rtol=0, atol=1e-6
    )
    assert torch.equal(out.topk_token_ids[:, 0], raw.argmax(dim=-1))


def test_logprobs_zero_gives_only_sampled() -> None:
    batch = make_batch([SamplingParams(logprobs=0)] * 2, 10)
    out = SAMPLER(random_logits(2, 10), batch)
    assert out.sampled_logprobs is not None and out.sampled_logprobs.shape == (2,)
    assert out.topk_logprobs is not None and out.topk_logprobs.shape == (2, 0)
    assert math.isfinite(out.sampled_logprobs.sum().item())


def test_argmax_rows_is_torchs_argmax_ties_included():
    from engine_core.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=g)
    logits[1, [7, 300, 40000]] = 50.0  # tied maxima: the lowest index
    logits[2] = float("-inf")
    logits[2, 12345] = 0.0  # everything else blocked
    logits[3, -1] = 99.0  # the very last
    assert torch.equal(argmax_rows(logits, native_sampling()), logits.argmax(dim=-1))
    assert argmax_rows(logits, native_sampling())[1] == 7
    small = torch.randn(3, 10, generator=g)  # below the native kernel's width: torch's
    assert torch.equal(argmax_rows(small, native_sampling()), small.argmax(dim=-1))


def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled() -> None:
    """+100 makes a token certain and -100 rules it out, in greedy and random rows alike;
    the bias comes before penalties and filters (a top_k=1 row follows the biased argmax)."""
    vocab_size = 64
    logits = random_logits(6, vocab_size, seed=3)
    order = logits.argsort(dim=-1, descending=True)  # [6, V]
    forced = 17
    params = [
        SamplingParams(temperature=0.0, logit_bias={forced: 100}),
        SamplingParams(temperature=1.0, seed=1, logit_bias={forced: 100.0}),
        SamplingParams(temperature=1.0, top_k=1, logit_bias={forced: 100}),
        SamplingParams(temperature=0.0, logit_bias={int(order[3, 0]): -100}),
        SamplingParams(temperature=0.0, logit_bias={int(order[4, 0]): -100,
                                                    int(order[4, 1]): -100}),
        SamplingParams(temperature=0.0),
    ]
    out = SAMPLER(logits.clone(), make_batch(params, vocab_size)).sampled_token_ids
    assert out[:3].tolist() == [forced] * 3
    assert out[3] == order[3, 1] and out[4] == order[4, 2] and out[5] == order[5, 0]
    # sampled rows never draw a banned token
    banned = [int(t) for t in order[0, :8]]
    counts = sample_many(SamplingParams(temperature=2.0, logit_bias={t: -100 for t in banned}),
                         logits[0])
    assert counts[banned].sum() == 0


def test_logit_bias_leaves_raw_logprobs_alone() -> None:
    logits = random_logits(1, 32, seed=4)
    raw = logits.log_softmax(dim=-1)
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias={5: 100})
    out = SAMPLER(logits.clone(), make_batch([params], 32))
    assert out.sampled_token_ids.tolist() == [5]
    assert torch.allclose(out.sampled_logprobs, raw[0, 5:6])


@pytest.mark.parametrize(("bias", "message"), [
    ({1: 100.5}, "logit_bias values must be in"),
    ({1: -101}, "logit_bias values must be in"),
    ({1: float("nan")}, "logit_bias must be a finite number"),
    ({-1: 1.0}, "logit_bias token ids must be >= 0"),
    ({"7": 1.0}, "logit_bias must be an int"),
    ({1: 1, 2: 2, **{t: 0 for t in range(3, 1100)}}, "logit_bias must have at most"),
])
def test_logit_bias_validation(bias: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_normalised_sorted_pairs() -> None:
    p = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert p.logit_bias == ((2, -3.5), (9, 1.0))
    assert p == SamplingParams(logit_bias=[(9, 1.0), (2, -3.5)])
