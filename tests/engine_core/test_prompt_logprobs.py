"""Prompt logprobs (SamplingParams.prompt_logprobs) on the real model: every prompt token's
logprob equals transformers' log_softmax of the same prompt, with chunked prefill too, and a
second request for the same prompt recomputes them instead of taking prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from engine_core.sampling_params import SamplingParams

PROMPT = ("The capital of France is Paris, and the capital of Germany is Berlin. The capital "
          "of Italy is")


@pytest.fixture(scope="module")
def reference(llm_fp32, hf_reference) -> tuple[list[int], torch.Tensor]:
    ids = llm_fp32.tokenizer.encode(PROMPT)
    with torch.no_grad():
        lp = hf_reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
    return ids, lp


def check(out, ids: list[int], lp: torch.Tensor, n: int) -> None:
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        assert next(iter(entry)) == ids[p]  # the prompt token first
        assert entry[ids[p]] == pytest.approx(lp[p - 1, ids[p]].item(), abs=2e-4)
        top = lp[p - 1].topk(n).indices.tolist() if n else []
        assert set(entry) == {ids[p], *top}


def test_prompt_logprobs_equal_transformers_and_survive_the_prefix_cache(llm_fp32, reference):
    ids, lp = reference
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    first = llm_fp32.generate(PROMPT, params)[0]
    check(first, ids, lp, 3)
    # the prompt's blocks are cached now: a plain request hits them, one with prompt logprobs
    # recomputes every position
    assert llm_fp32.generate(PROMPT, SamplingParams(max_tokens=1))[0].num_cached_tokens > 0
    again = llm_fp32.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0
    check(again, ids, lp, 0)
    assert llm_fp32.generate(PROMPT, SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_prompt_logprobs_with_chunked_prefill(model_path, reference):
    from engine_core.llm import LLM

    ids, lp = reference
    llm = LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.05, quantize_decode=False,
              max_num_batched_tokens=8)  # the prompt takes 3 chunks
    outs = llm.generate([PROMPT, "Hello there, how"],
                        [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
                         SamplingParams(max_tokens=2, temperature=0)])
    check(outs[0], ids, lp, 1)
    assert outs[1].prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, True])
def test_prompt_logprobs_bounds(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
