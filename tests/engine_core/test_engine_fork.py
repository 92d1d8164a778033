"""Forks on a real (tiny, random) model: n samples of a prompt computed once, each child's
output equal to a request of its own (seeded: seed + i), every block back in the pool."""

from __future__ import annotations

import pytest

from engine_core.engine import LLMEngine
from engine_core.engine_config import CacheConfig, DeviceConfig, LoadConfig, SpeculativeConfig
from engine_core.sampling_params import SamplingParams
from tests.tiny_model import write_tiny_llama

PROMPT = list(range(10, 31))  # 21 tokens: one full block of 16 and a partial one
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_engine(tiny, spec: SpeculativeConfig | None = None, **cache) -> LLMEngine:
    return LLMEngine(LoadConfig(str(tiny), dtype="float32", quantize_decode=False),
                     DeviceConfig("cpu"), CacheConfig(num_blocks=NUM_BLOCKS, **cache),
                     speculative_config=spec)


def run(engine: LLMEngine, ids: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return {i: out[i] for i in ids if i in out}


def samples(engine: LLMEngine, n: int, params: SamplingParams) -> list[str]:
    engine.add_request(PROMPT, params, req_id="s0")
    for i in range(1, n):
        seed = None if params.seed is None else params.seed + i
        engine.add_request(PROMPT, SamplingParams(**{**params.__dict__, "seed": seed}),
                           req_id=f"s{i}", fork_of="s0")
    return [f"s{i}" for i in range(n)]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_children_equal_requests_of_their_own_and_the_prompt_is_computed_once(tiny,
                                                                              temperature):
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=7, ignore_eos=True)
    alone = make_engine(tiny, enable_prefix_caching=False)
    expected = []
    for i in range(3):
        rid = alone.add_request(PROMPT, SamplingParams(**{**params.__dict__, "seed": 7 + i}))
        expected.append(run(alone, [rid])[rid])

    engine = make_engine(tiny)
    ids = samples(engine, 3, params)
    got = run(engine, ids)
    assert [got[i] for i in ids] == expected
    if temperature == 0.0:  # greedy: n identical choices
        assert expected[0] == expected[1] == expected[2]
    # the prompt once, then one token per child (its own first token's logits)
    assert engine.stats.num_prompt_tokens == len(PROMPT) + 2
    assert engine.scheduler.num_forks == 2
    assert_all_blocks_free(engine)


def test_children_drafting_with_a_separate_draft_cache_equal_lone_requests(tiny):
    """Forks under a draft model with its own cache (indexed by the same block ids, so it is
    copied on write too; a child's draft catches up from position 0 anyway): greedy children
    equal a lone greedy request and the drafts stay accepted."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = make_engine(tiny, enable_prefix_caching=False)
    rid = alone.add_request(PROMPT, params)
    expected = run(alone, [rid])[rid]
    engine = make_engine(tiny, SpeculativeConfig("draft", 3, draft_model=str(tiny)))
    ids = samples(engine, 3, params)
    got = run(engine, ids)
    assert [got[i] for i in ids] == [expected] * 3
    assert engine.spec.stats.num_steps > 0
    assert min(engine.spec.stats.acceptance_rate()) > 0.9  # the model drafting for itself
    assert_all_blocks_free(engine)


def test_aborting_one_child_or_all_frees_every_block(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True)
    ids = samples(engine, 4, params)
    engine.abort_request("s3")  # before the fork
    engine.step()  # the parent's prefill: s1 and s2 fork
    engine.step()
    engine.abort_request("s1")  # one child, mid-decode
    engine.step()
    engine.abort_request(ids)  # all the rest
    assert not engine.has_unfinished_requests()
    engine.step()
    assert_all_blocks_free(engine)
