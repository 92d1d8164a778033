"""A mixture of experts served by `pdserve up --quantization int8`: a tiny random Qwen3-MoE
(tests/tiny_model.py, 4 experts, 2 per token, a word-level tokenizer, float weights) in the
dtype the CPU picks, the prefill worker dense, the decode worker's experts requantized to int8
for decode rows (the flag reaching the workers), the KV handed over by the default transport.
Greedy completions equal the offline engine's with the same settings. (On the defaults its
float weights stay float in every row: tests/engine_core/test_moe.py.)"""

from __future__ import annotations

import pytest
from transformers import Qwen3MoeConfig

from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.e2e.stack import check_word_completions, spawn_stack, stop_stack, wait_stack
from tests.tiny_model import words, write_tiny_llama

pytestmark = pytest.mark.slow

# several blocks long, one repeating, one token
PROMPTS = [list(range(3, 60)), [5, 9, 200, 31] * 5, [11]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-moe"), config_cls=Qwen3MoeConfig,
                            head_dim=32, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=64, norm_topk_prob=True)


def test_pdserve_up_serves_a_mixture_of_experts(tiny_moe):
    llm = LLM(model=str(tiny_moe), kv_cache_memory_gb=0.05, quantization="int8")
    assert llm.engine.model_config.num_experts == 4
    # every expert requantized for decode rows (the decode worker's too)
    experts = llm.engine.model.layers[0].mlp.experts
    assert all(type(e.down_proj).__name__ == "DecodeQuantLinear" for e in experts)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([words(p) for p in PROMPTS],
                                                             params)]
    stack = wait_stack(*spawn_stack("--kv-cache-memory-gb", "0.05", "--model", str(tiny_moe),
                                    "--quantization", "int8"))
    try:
        check_word_completions(stack, PROMPTS, expected, MAX_TOKENS)
    finally:
        assert stop_stack(stack) == 0
