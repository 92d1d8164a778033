"""Async scheduling (engine_core/async_step.py) on the CPU, through the same code path it runs
on CUDA: the greedy output (tokens, text, finish and stop reasons, logprobs) equals the
synchronous loop's; requests that end or are aborted while a step is in flight, and
preemption, leave the KV pool whole; a step that cannot run ahead runs synchronously."""

from __future__ import annotations

import pytest

from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.tiny_model import write_tiny_llama

NUM = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


def workload():
    """Lengths 10..59, EOS honoured by a third, stop strings, logprobs, seeds."""
    prompts = [[3 + (i * 7 + j) % 500 for j in range(5 + 3 * i)] for i in range(NUM)]
    params = [SamplingParams(max_tokens=10 + (i * 13) % 50, temperature=0.0,
                             ignore_eos=i % 3 != 0, stop=["w7"] if i % 5 == 0 else [],
                             logprobs=2 if i % 4 == 0 else None,
                             seed=i if i % 6 == 0 else None) for i in range(NUM)]
    return prompts, params


def run(model: str, async_scheduling: bool, num_kv_blocks: int, params=None):
    llm = LLM(model, max_num_seqs=16, num_kv_blocks=num_kv_blocks,
              async_scheduling=async_scheduling)
    prompts, default_params = workload()
    outs = llm.generate(prompts, params or default_params)
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.pool.num_blocks
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
            o.outputs[0].stop_reason, o.outputs[0].logprobs) for o in outs]
    return got, llm.engine


def test_async_output_equals_the_synchronous_loops(tiny):
    sync, _ = run(tiny, False, 512)
    ahead, engine = run(tiny, True, 512)
    assert ahead == sync
    assert engine.stats.num_async_steps > 50 and engine.stats.num_sync_steps == 0
    assert engine.scheduler.num_preemptions == 0  # equal only where nothing recomputes
    reasons = {r for _, _, r, _, _ in sync}
    assert reasons == {"length", "stop"}  # EOS or a stop string ended some


def test_preemption_under_async_scheduling_frees_everything(tiny):
    """A pool too small for the batch: requests are preempted while their tokens are in
    flight (those are dropped, their epoch changed); every request still gets its tokens."""
    got, engine = run(tiny, True, 40)
    assert engine.scheduler.num_preemptions > 0
    _, params = workload()
    for (tokens, _, reason, _, _), p in zip(got, params, strict=True):
        assert reason == "stop" or len(tokens) == p.max_tokens


def test_a_request_aborted_while_its_step_is_in_flight(tiny):
    llm = LLM(tiny, max_num_seqs=8, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request([3 + i, 9, 11], params, req_id=f"a{i}")
    seen: dict[str, list[int]] = {}
    for _ in range(5):
        for d in engine.step_deltas():
            seen.setdefault(d.req_id, []).extend(d.token_ids)
    assert engine._ahead.inflight is not None  # a step is launched, not read
    engine.abort_request("a1")
    while engine.has_unfinished_requests():
        for d in engine.step_deltas():
            assert d.req_id != "a1"  # its in-flight token was dropped
            seen.setdefault(d.req_id, []).extend(d.token_ids)
    engine.step_deltas()  # reads whatever is still in flight
    assert [len(seen[f"a{i}"]) for i in (0, 2, 3)] == [30, 30, 30]
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_a_step_that_cannot_run_ahead_runs_synchronously(tiny):
    """Penalties count each token before the next is sampled: while such a request is in
    the batch, steps run synchronously, and the output equals the synchronous loop's."""
    _, params = workload()
    params = [SamplingParams(**{**p.__dict__, "repetition_penalty": 1.3}) if i == 3 else p
              for i, p in enumerate(params)]
    sync, _ = run(tiny, False, 512, params)
    ahead, engine = run(tiny, True, 512, params)
    assert ahead == sync
    assert engine.stats.num_sync_steps > 0 and engine.stats.num_async_steps > 0
