"""Penalties from incrementally kept token counts: the counts equal a recount after any
sequence of appends, a preempted (or migrated) request's row rebuilds them from its tokens, and
the sparse application equals the dense formula bit for bit."""

from __future__ import annotations

import random
from collections import Counter

import torch

from engine_core.model_runner import InputBatch
from engine_core.penalties import PenaltyTokens, TokenCounts, apply_penalties
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams


def as_table(counts: TokenCounts) -> dict[int, tuple[float, bool]]:
    n = counts.num_tokens
    return {int(t): (float(c), bool(p)) for t, c, p in zip(
        counts.token_ids[:n], counts.output_counts[:n], counts.in_prompt[:n], strict=True)}


def recount(prompt: list[int], output: list[int]) -> dict[int, tuple[float, bool]]:
    out = Counter(output)
    return {t: (float(out[t]), t in set(prompt)) for t in set(prompt) | set(output)}


def test_incremental_counts_equal_a_recount():
    rng = random.Random(0)
    prompt = [rng.randrange(50) for _ in range(40)]
    counts = TokenCounts(prompt)
    output: list[int] = []
    for _ in range(100):  # past the initial capacity of 64 distinct tokens
        new = [rng.randrange(120) for _ in range(rng.randrange(1, 4))]
        counts.append(new)
        output += new
        assert as_table(counts) == recount(prompt, output)
    assert counts.num_tokens > 64


def dense_penalties(logits, prompts, outputs, rep, pres, freq):
    """The formula over the whole vocabulary (the sampler's former dense implementation)."""
    num_rows, vocab = logits.shape
    counts = torch.zeros(num_rows, vocab)
    in_prompt = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for r in range(num_rows):
        for t in outputs[r]:
            counts[r, t] += 1
        in_prompt[r, list(prompts[r])] = True
    seen = in_prompt | (counts > 0)
    r_ = rep.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / r_, logits * r_), logits)
    logits -= freq.unsqueeze(1) * counts
    logits -= pres.unsqueeze(1) * (counts > 0)
    return logits


def test_sparse_application_equals_the_dense_formula_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    vocab, rows = 300, 5
    logits = torch.randn(rows, vocab, generator=g) * 4
    prompts = [torch.randint(0, vocab, (30,), generator=g).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (50,), generator=g).tolist() for _ in range(rows)]
    rep = torch.tensor([1.3, 1.0, 0.7, 1.0, 2.0])
    pres = torch.tensor([0.5, -1.0, 0.0, 0.0, 2.0])
    freq = torch.tensor([0.25, 0.0, 1.5, 0.0, -2.0])  # row 3 neutral
    tokens = PenaltyTokens.from_counts([TokenCounts(p, o) for p, o in zip(prompts, outputs,
                                                                          strict=True)])
    got = apply_penalties(logits.clone(), tokens, rep, pres, freq)
    expected = dense_penalties(logits.clone(), prompts, outputs, rep, pres, freq)
    assert torch.equal(got, expected)
    assert torch.equal(got[3], logits[3])  # neutral values: bit for bit unchanged


def request(req_id: str, params: SamplingParams) -> Request:
    return Request(req_id, [5, 6, 7, 5], params)


def test_rows_keep_counts_and_rebuild_them_after_preemption():
    batch = InputBatch(max_rows=4, max_model_len=64, block_size=4)
    penalised = request("p", SamplingParams(frequency_penalty=0.5))
    plain = request("q", SamplingParams())
    row = batch.row(penalised)
    assert batch.row(plain) not in batch.token_counts  # no penalties: nothing kept
    for token in [9, 5, 9, 11]:
        penalised.append_output_token(token)
        batch.append(row, penalised)
    assert batch.num_tokens[row] == penalised.num_tokens
    assert as_table(batch.token_counts[row]) == recount(penalised.prompt_token_ids,
                                                        penalised.output_token_ids)
    # preempted: the row goes; recomputed later, the new row counts the request's tokens again
    batch.remove("p")
    assert row not in batch.token_counts
    penalised.append_output_token(9)
    row = batch.row(penalised)
    assert as_table(batch.token_counts[row]) == recount(penalised.prompt_token_ids,
                                                        penalised.output_token_ids)
    assert batch.token_counts[row].output_counts[:batch.token_counts[row].num_tokens].sum() == 5


def test_a_continuation_counts_its_prior_output_as_output():
    """A request migrated after a lost worker arrives as prompt + the tokens already streamed;
    the penalties must keep counting those as output on the new worker."""
    params = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2)
    cont = Request("m~1", [5, 6, 7, 9, 9, 4], params, num_prior_output_tokens=3)
    assert cont.penalty_prompt_and_output == ([5, 6, 7], [9, 9, 4])
    batch = InputBatch(max_rows=2, max_model_len=64, block_size=4)
    row = batch.row(cont)
    assert as_table(batch.token_counts[row]) == recount([5, 6, 7], [9, 9, 4])
    cont.append_output_token(9)
    batch.append(row, cont)
    assert as_table(batch.token_counts[row])[9] == (3.0, False)


def test_prior_output_must_leave_a_prompt():
    import pytest

    with pytest.raises(ValueError, match=r"num_prior_output_tokens must be in \[0, 3\)"):
        Request("x", [1, 2, 3], SamplingParams(), num_prior_output_tokens=3)
