"""What the engine refuses when a request is added (token ids outside the vocabulary, with the
field and the bound named; the engine goes on serving), and an EOS id outside the vocabulary
in a model's config (ignored with a warning: it could never be sampled, and once tripped an
assertion in the sampler when min_tokens blocked it)."""

from __future__ import annotations

import logging

import pytest

from engine_core.engine import LLMEngine
from engine_core.engine_config import CacheConfig, DeviceConfig, LoadConfig
from engine_core.sampling_params import SamplingParams
from tests.tiny_model import TINY, write_tiny_llama

VOCAB = TINY["vocab_size"]


def make_engine(folder) -> LLMEngine:
    return LLMEngine(LoadConfig(str(folder), dtype="float32", quantize_decode=False),
                     DeviceConfig("cpu"), CacheConfig(num_blocks=32))


def run(engine: LLMEngine, params: SamplingParams) -> list[int]:
    req_id = engine.add_request([5, 6, 7], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == req_id:
                return list(out.outputs[0].token_ids)
    raise AssertionError("the request did not finish")


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    return make_engine(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ([5, VOCAB], SamplingParams(), rf"prompt token ids must be in \[0, {VOCAB}\)"),
    ([5], SamplingParams(stop_token_ids=[3, VOCAB + 7]),
     rf"stop_token_ids must be in \[0, {VOCAB}\), got \[{VOCAB + 7}\]"),
    ([5], SamplingParams(logit_bias={VOCAB: 1.0}),
     rf"logit_bias token ids must be in \[0, {VOCAB}\), got \[{VOCAB}\]"),
])
def test_token_ids_outside_the_vocabulary_are_refused(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()  # nothing was admitted
    assert len(run(engine, SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))) == 4


def test_an_eos_id_outside_the_vocabulary_is_ignored(tmp_path, caplog):
    folder = write_tiny_llama(tmp_path, eos_token_id=[1, VOCAB + 88])
    with caplog.at_level(logging.WARNING, logger="engine_core.engine"):
        eng = make_engine(folder)
    assert eng.eos_token_ids == (1,)
    assert f"EOS token ids [{VOCAB + 88}] are outside the model's vocabulary of {VOCAB}" in (
        caplog.text)
    # min_tokens blocks every EOS id in the sampler: the in-vocabulary one still ends requests
    assert len(run(eng, SamplingParams(max_tokens=6, min_tokens=3, temperature=0.8,
                                       seed=1))) in range(3, 7)
    assert len(run(eng, SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0))) == 5
