"""SamplingRows (the model runner's persistent per-row parameters) give the same SamplingBatch
as SamplingBatch.from_requests over the same requests, field by field: random parameters,
rows in any order, some requests before their min_tokens, penalties and logit bias."""

from __future__ import annotations

import random

import numpy as np
import torch

from engine_core.penalties import TokenCounts
from engine_core.request import Request
from engine_core.sampling_batch import SamplingBatch
from engine_core.sampling_params import SamplingParams
from engine_core.sampling_rows import SamplingRows

VOCAB = 97
EOS = (1, 5)


def random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    fields = dict(max_tokens=64, temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.3]),
                  top_k=rng.choice([-1, 0, 5, 200]), top_p=rng.choice([1.0, 0.9]),
                  min_p=rng.choice([0.0, 0.05]), min_tokens=rng.choice([0, 0, 3]),
                  stop_token_ids=tuple(rng.sample(range(10, 20), rng.randint(0, 2))),
                  ignore_eos=rng.random() < 0.2)
    if rng.random() < 0.3:
        fields.update(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.1)
    if rng.random() < 0.3:
        fields["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(2)}
    if rng.random() < 0.3:
        fields["logprobs"] = rng.choice([0, 2, 5])
    if rng.random() < 0.3:
        fields["seed"] = rng.randrange(1000)
    return SamplingParams(**fields)


def assert_same(a: SamplingBatch, b: SamplingBatch) -> None:
    for name in ("temperature", "is_greedy", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("max_num_logprobs", "vocab_size", "all_greedy", "all_random", "no_penalties",
                 "no_top_k", "no_top_p", "no_min_p"):
        assert getattr(a, name) == getattr(b, name), name
    assert [g is h for g, h in zip(a.generators, b.generators, strict=True)] == [True] * len(
        a.generators)
    for name in ("blocked_token_ids", "bias_token_ids", "bias_values"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:  # the same pairs, in the same order
            assert torch.equal(x, y), name
    if a.penalty_tokens is not None:
        for name in ("rows", "token_ids", "output_counts"):
            assert torch.equal(getattr(a.penalty_tokens, name),
                               getattr(b.penalty_tokens, name)), name
    else:
        assert b.penalty_tokens is None


def test_rows_give_the_batch_from_requests():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 12)
        reqs = []
        for i in range(n):
            req = Request(f"r{i}", [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 9))],
                          random_params(rng), EOS)
            for _ in range(rng.randint(0, 6)):
                req.append_output_token(rng.randrange(2, VOCAB))
            reqs.append(req)
        rows = SamplingRows(32, VOCAB, EOS)
        row_of = rng.sample(range(32), n)  # rows in any order
        counts = {}
        for req, row in zip(reqs, row_of, strict=True):
            rows.set_row(row, req)
            if req.sampling_params.has_penalties:
                counts[row] = TokenCounts(*req.penalty_prompt_and_output)
        batch = rows.batch(np.asarray(row_of), np.asarray([r.num_tokens for r in reqs]),
                           counts, torch.device("cpu"))
        want = SamplingBatch.from_requests(
            [r.sampling_params for r in reqs], [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs], [r.generator for r in reqs], VOCAB,
            eos_token_ids=EOS, token_counts=[counts.get(row) for row in row_of])
        assert_same(batch, want)
