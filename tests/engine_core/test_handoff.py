"""The decode side of a handoff in one process: reserve blocks, copy a prefill engine's KV
into them, admit with its first token. The result must equal a colocated run."""

from __future__ import annotations

import pytest

from engine_core.kv_cache.manager import cdiv
from engine_core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "In a quiet harbor town, the lighthouse keeper kept a notebook of every ship that " * 2


@pytest.fixture(scope="module")
def prefill_llm(model_path):
    from engine_core.llm import LLM

    return LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.05,
               enable_prefix_caching=False, quantize_decode=False)


def handoff(prefill_llm, decode_llm, ids, params, req_id):
    """Prefill on one engine, move the prompt's KV block by block, decode on the other."""
    first_params = SamplingParams(**{**params.__dict__, "max_tokens": 1, "min_tokens": 0})
    pre = prefill_llm.engine
    seen: list[list[int]] = []  # the request's blocks, as a KV connector sees them

    class Recorder:  # engine_core/kv_connector.py: the scheduler side only
        def build_step(self, out, block_ids):
            seen.append(list(block_ids[0]))

    pre.kv_connector = Recorder()
    pre.add_request(ids, first_params)
    try:
        while pre.has_unfinished_requests():
            outs = pre.step()
    finally:
        pre.kv_connector = None
    src_blocks = seen[-1]  # freed after the step, but nothing has overwritten them yet
    first = outs[0].outputs[0].token_ids[0]
    dec = decode_llm.engine
    blocks, num_cached = dec.reserve(ids, params, req_id)
    n = cdiv(len(ids), dec.layout.block_size)
    skip = num_cached // dec.layout.block_size
    # [layers, blocks, ...]: copy every layer of the blocks the decode engine lacks
    dec.runner.kv_cache[:, blocks[skip:n]] = pre.runner.kv_cache[:, src_blocks[skip:n]]
    got = [dec.admit_prefilled(req_id, first)]
    while dec.has_unfinished_requests():
        got += dec.step_deltas()
    return [t for d in got for t in d.token_ids], num_cached


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_handoff_equals_colocated(prefill_llm, llm_fp32, params):
    ids = llm_fp32.tokenizer.encode(PROMPT)
    llm_fp32.engine.kv.pool.reset_prefix_cache()
    expected = llm_fp32.generate(ids, params)[0].outputs[0].token_ids
    llm_fp32.engine.kv.pool.reset_prefix_cache()
    got, num_cached = handoff(prefill_llm, llm_fp32, ids, params, f"h-{params.seed}")
    assert num_cached == 0 and got == expected
    # the same prompt again: the decode engine caches its full prompt blocks now, only the
    # rest is moved, and the output is unchanged
    got, num_cached = handoff(prefill_llm, llm_fp32, ids, params, f"h2-{params.seed}")
    assert num_cached >= 16 and got == expected
    kv = llm_fp32.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.pool.num_blocks


@pytest.fixture(scope="module")
def prefill_llm_default(model_path):
    """The prefill worker's engine on the defaults: dtype auto, no quantized decode (it never
    decodes), attention in the C kernels as a colocated engine's prefill."""
    from engine_core.llm import LLM

    return LLM(str(model_path), kv_cache_memory_gb=0.05, enable_prefix_caching=False,
               quantize_decode=False)


def test_handoff_on_the_defaults_equals_colocated(prefill_llm_default, offline_default):
    """What `pdserve up` runs by default (bf16 prefill, int8 decode activations where the CPU
    has them): the prefill worker's KV and first token continue on the decode engine exactly
    as the same engine continues its own prefill. (It did not while the prefill worker's
    attention ran in torch: bf16 rounding moved the KV by an ulp, and greedy text diverged.)"""
    llm = offline_default.llm
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = llm.tokenizer.encode("A short history of the printing press: it began")
    llm.engine.kv.pool.reset_prefix_cache()
    expected = llm.generate(ids, params)[0].outputs[0].token_ids
    llm.engine.kv.pool.reset_prefix_cache()
    got, _ = handoff(prefill_llm_default, llm, ids, params, "h-default")
    assert got == expected
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_reserve_refuses_when_full_and_abort_frees(model_path):
    from engine_core.llm import LLM

    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=6, max_num_seqs=2,
              quantize_decode=False)
    eng = llm.engine
    ids = list(range(100, 140))  # 40 tokens: 3 blocks
    params = SamplingParams(max_tokens=4)
    assert eng.reserve(ids, params, "a") is not None
    assert eng.reserve(ids[:-1] + [7], params, "b") is not None
    assert eng.reserve([5, 6, 7], params, "c") is None  # max_num_seqs counts reservations
    assert eng.kv.num_free_blocks == 0 and eng.scheduler.num_reserved == 2
    assert not eng.has_work()  # nothing to compute until KV arrives
    eng.abort_request(["a", "b"])
    assert eng.kv.num_free_blocks == 6 and eng.scheduler.num_reserved == 0
    eng.kv.check_integrity()
