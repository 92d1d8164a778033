"""`pdserve up --prefill-weights quantized` on the default model (a Q4_1 GGUF): every worker's
prefill rows multiply the file's blocks, with no dense copy of the projections, and greedy
output equals the offline engine's with the same setting. The prefill worker's KV is what the
decode worker continues from, so both must prefill the same way: `pdserve up` gives every
worker the one setting (and settles "auto" once for all of them)."""

from __future__ import annotations

import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    LONG,
    greedy,
    metric,
    out_ids,
    run,
    spawn_stack,
    stop_stack,
    wait_stack,
)
from tests.helpers import kill_tree, log_tail, torch_threads

pytestmark = pytest.mark.slow

N = 12
PROMPTS = ["The capital of France is", " ".join([LONG] * 3)]


def test_up_prefills_from_the_files_blocks():
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams

    proc, log = spawn_stack("--transport", "shm", "--prefill-weights", "quantized")
    try:
        llm = LLM(kv_cache_memory_gb=0.25, prefill_weights="quantized")  # loads meanwhile
        stack = wait_stack(proc, log)
    except BaseException:
        kill_tree(proc)
        raise
    try:
        assert llm.engine.prefill_weights == "quantized"
        with torch_threads(1):  # as each worker, on its pinned core
            expected = [o.outputs[0].token_ids for o in llm.generate(
                PROMPTS, SamplingParams(max_tokens=N, temperature=0.0))]
        for prompt, ids in zip(PROMPTS, expected, strict=True):
            msgs = run(stack.generation(), pb.GenerateRequest(text=prompt, sampling=greedy(N)))
            assert out_ids(msgs) == ids, prompt[:40]
        stack.wait_idle()
        for url in stack.metrics[1:]:  # each worker's, prefill first
            assert metric(url, "pdserve:weights_info", 'prefill_weights="quantized"') == 1, url
    finally:
        code = stop_stack(stack)
    text = log_tail(stack.log, 10**7)
    assert code == 0 and "Traceback" not in text, text[-4000:]
