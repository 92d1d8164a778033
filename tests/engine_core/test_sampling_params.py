"""SamplingParams: defaults, normalisation, and one rejection per bound."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine_core.sampling_params import (
    MAX_NUM_LOGPROBS,
    MAX_NUM_STOP_STRINGS,
    MAX_STOP_STRING_LEN,
    SamplingParams,
)


def test_defaults_are_valid_and_neutral() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.temperature == 1.0 and not p.is_greedy
    assert p.top_p == 1.0 and p.top_k == -1 and p.min_p == 0.0
    assert not p.has_penalties
    assert p.seed is None and p.logprobs is None
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.ignore_eos and p.skip_special_tokens


def test_stop_accepts_str_and_lists_and_is_immutable() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[7, 9])  # type: ignore[arg-type]
    assert p.stop == ("a", "b") and p.stop_token_ids == (7, 9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_p = 0.5  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(7, 9)))


@pytest.mark.parametrize(
    ("temperature", "is_greedy"), [(0.0, True), (9e-6, True), (1e-5, False), (0.7, False)]
)
def test_is_greedy(temperature: float, is_greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


def test_all_stop_token_ids() -> None:
    assert SamplingParams(stop_token_ids=(5,)).all_stop_token_ids([2]) == {2, 5}
    assert SamplingParams(stop_token_ids=(5,), ignore_eos=True).all_stop_token_ids([2]) == {5}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1, min_tokens=1),
        dict(temperature=0.0),
        dict(top_p=1e-9),
        dict(top_k=0),
        dict(top_k=1),
        dict(min_p=1.0),
        dict(repetition_penalty=1e-3),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(seed=0),
        dict(seed=2**64 - 1),
        dict(seed=-(2**63)),
        dict(stop=["x" * MAX_STOP_STRING_LEN] * MAX_NUM_STOP_STRINGS),
        dict(logprobs=0),
        dict(logprobs=MAX_NUM_LOGPROBS),
    ],
)
def test_boundary_values_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


# (kwargs, substring the message must contain: the field name, and the bound where useful)
BAD_VALUES = [
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(max_tokens=2.0), "max_tokens must be an int"),
    (dict(max_tokens=True), "max_tokens must be an int"),
    (dict(min_tokens=-1), "min_tokens must be in [0, max_tokens=16]"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens must be in [0, max_tokens=4]"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(temperature=math.nan), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-2), "top_k must be -1 or 0 (disabled) or >= 1"),
    (dict(top_k=1.5), "top_k must be an int"),
    (dict(min_p=-0.01), "min_p must be in [0, 1]"),
    (dict(min_p=1.01), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=-2.01), "presence_penalty must be in [-2.0, 2.0]"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2.0, 2.0]"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2.0, 2.0]"),
    (dict(frequency_penalty=2.01), "frequency_penalty must be in [-2.0, 2.0]"),
    (dict(seed=2**64), "seed must be in"),
    (dict(seed=-(2**63) - 1), "seed must be in"),
    (dict(seed="7"), "seed must be an int"),
    (
        dict(stop=["s"] * (MAX_NUM_STOP_STRINGS + 1)),
        f"stop must have at most {MAX_NUM_STOP_STRINGS}",
    ),
    (dict(stop=[""]), f"stop strings must have 1 to {MAX_STOP_STRING_LEN} characters"),
    (dict(stop=["x" * (MAX_STOP_STRING_LEN + 1)]), "stop strings must have 1 to"),
    (dict(stop=[3]), "stop must contain only strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be >= 0"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be an int"),
    (dict(logprobs=-1), f"logprobs must be None or in [0, {MAX_NUM_LOGPROBS}]"),
    (dict(logprobs=MAX_NUM_LOGPROBS + 1), f"logprobs must be None or in [0, {MAX_NUM_LOGPROBS}]"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_bad_values_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)
