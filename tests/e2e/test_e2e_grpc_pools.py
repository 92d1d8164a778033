"""End to end through one `pdserve up --transport grpc --prefill 2 --decode 2` stack: exact greedy
output with the KV shipped over the grpc transport, and concurrent requests spread over both
prefill and both decode workers, all completing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    BLOCK_SIZE,
    PROMPTS,
    cacheable_tokens,
    check_greedy_chat,
    check_greedy_text,
    check_repeat_hits_decode_cache,
    greedy,
    handoff,
    out_ids,
    probe_decode_cache,
    run,
)

pytestmark = pytest.mark.slow

# distinct first KV blocks, so that no prompt hits another's prefix in any cache
SPREAD_PROMPTS = [
    "Alice opened the old wooden door at the end of the corridor and, to her great surprise, saw",
    "The ocean covers most of the surface of our planet, and scientists still know very little "
    "about",
    "In 1850 the small town by the river had a mill, two churches, a school and a market where",
    "Python is a programming language that many people use because it is easy to read, and it",
    "Mount Everest is the highest mountain above sea level; every year hundreds of climbers try "
    "to reach",
    "A small robot woke up in an empty warehouse one morning and decided that the first thing",
    "Bread has been baked for thousands of years, starting with flat loaves cooked on hot stones",
    "Jupiter, the largest planet in the solar system, has a giant storm that has lasted for",
]
SPREAD_TOKENS = 24


@pytest.fixture(scope="module")
def stack(stack_factory):
    start, stop = stack_factory
    s = start("--transport", "grpc", "--prefill", "2", "--decode", "2")
    assert (len(s.prefill), len(s.decode)) == (2, 2)
    yield s
    stop(s)


# -- 1. exact greedy output over the grpc transport ------------------------------------------
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_offline_engine(stack, ref, name):
    check_greedy_text(stack, ref, PROMPTS[name])


def test_chat_matches_offline_engine(stack, ref):
    check_greedy_chat(stack, ref)


def test_repeat_hits_decode_prefix_cache_and_matches(stack, ref):
    check_repeat_hits_decode_cache(stack, ref, "grpc")


# -- 4. two pools of two workers -------------------------------------------------------------
def test_concurrent_requests_spread_over_both_pools(stack, ref):
    """Eight requests at once all complete; afterwards each worker's prefix cache tells which
    prompts it served (a worker keeps a served prompt's whole blocks, and none of these
    prompts shares a block with another): every prompt went through exactly one prefill and
    one decode worker, and every worker took some."""
    prompts = [ref.tokenizer.encode(p) for p in SPREAD_PROMPTS]
    assert all(len(ids) > BLOCK_SIZE for ids in prompts), [len(ids) for ids in prompts]
    assert len({tuple(ids[:BLOCK_SIZE]) for ids in prompts}) == len(prompts)
    stub = stack.generation()

    def one(ids: list[int]) -> list[pb.GenerateResponse]:
        return run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                            sampling=greedy(SPREAD_TOKENS, ignore_eos=True)))

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    for msgs in results:
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(out_ids(msgs)) == msgs[-1].usage.completion_tokens == SPREAD_TOKENS
    stack.wait_idle()

    def served(cached: dict[str, list[int]]) -> dict[str, list[int]]:
        for address, values in cached.items():  # all of a prompt's whole blocks, or none
            assert all(v in (0, cacheable_tokens(len(ids))) for v, ids in zip(
                values, prompts, strict=True)), (address, values)
        return {a: [i for i, v in enumerate(values) if v] for a, values in cached.items()}

    decoded = served({a: [probe_decode_cache(stack, a, ids) for ids in prompts]
                      for a in stack.decode})
    # a prefill probe adds the prompt to that prefill worker's cache only (each prompt is
    # probed there once; the handoff is aborted, so the decode worker publishes nothing)
    prefilled = served({
        a: [handoff(stack, a, ids, stack.decode[0], "grpc")[0].num_cached_tokens
            for ids in prompts] for a in stack.prefill})
    print(f"prompts per decode worker: {decoded}; per prefill worker: {prefilled}")
    for pool, by_worker in (("decode", decoded), ("prefill", prefilled)):
        counts = {a: len(ids) for a, ids in by_worker.items()}
        assert sorted(i for ids in by_worker.values() for i in ids) == list(
            range(len(prompts))), f"{pool}: each prompt on exactly one worker: {by_worker}"
        assert all(counts.values()), f"{pool}: a worker took no request: {counts}"
