"""The engine against transformers on the real SmolLM2-135M-Instruct GGUF (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from engine_core.kv_cache.layout import KVLayout
from engine_core.model.attention import AttentionMetadata
from engine_core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Paris is the capital of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position from one prefill into a fresh paged cache whose block
    table is a random permutation (so paging is exercised, not just contiguous memory)."""
    eng = llm.engine
    layout: KVLayout = eng.layout
    bs = layout.block_size
    num_blocks = -(-len(ids) // bs) + 3
    kv = layout.allocate(num_blocks)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[: -3 or None]
    table = table[: -(-len(ids) // bs)].to(torch.int32)
    pos = torch.arange(len(ids))
    meta = AttentionMetadata(
        slot_mapping=(table[pos // bs].long() * bs + pos % bs),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=table[None],
        prefill_query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
    )
    with torch.inference_mode():
        hidden = eng.model(torch.tensor(ids), pos, kv, meta)
        return eng.model.compute_logits(hidden)


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_logits_match_transformers(llm_fp32, hf_reference, prompt):
    ids = llm_fp32.tokenizer.encode(prompt)
    ours = prompt_logits(llm_fp32, ids)
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([ids])).logits[0].float()
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-3, f"max relative error {rel:.2e} for {prompt!r}"


def test_greedy_matches_transformers(llm_fp32, hf_reference):
    # min_tokens blocks EOS exactly as transformers' min_new_tokens does: 64 tokens each
    params = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0)
    ours = llm_fp32.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([llm_fp32.tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf_reference.generate(
                ids, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                attention_mask=torch.ones_like(ids), pad_token_id=0,
            )[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, f"greedy continuation differs for {prompt!r}"


def test_batched_with_arrivals_equals_one_at_a_time(llm_fp32):
    assert_batched_equals_solo(llm_fp32)


def assert_batched_equals_solo(llm) -> None:
    """Requests join while others decode; each must get exactly its solo tokens."""
    prompts = [p * k for k, p in zip((1, 3, 2, 5, 1), PROMPTS, strict=True)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (24, 9, 17, 30, 12)]
    solo = [llm.generate(p, sp)[0].outputs[0].token_ids
            for p, sp in zip(prompts, params, strict=True)]
    eng = llm.engine
    eng.kv.pool.reset_prefix_cache()  # no help from the solo runs' cached blocks
    results: dict[str, list[int]] = {}
    pending = list(zip(prompts, params, strict=True))
    ids: list[str] = []
    step = 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step
            p, sp = pending.pop(0)
            ids.append(eng.add_request(p, sp))
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in ids] == solo
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_prefix_cache_hit_equals_miss(llm_fp32):
    eng = llm_fp32.engine
    eng.kv.pool.reset_prefix_cache()
    shared = "You are a careful assistant. Answer briefly and precisely. " * 4
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    miss = llm_fp32.generate(shared + "What is 2+2?", params)[0]
    hit = llm_fp32.generate(shared + "What is 2+2?", params)[0]
    other = llm_fp32.generate(shared + "Name a color.", params)[0]
    assert miss.num_cached_tokens == 0
    assert hit.num_cached_tokens >= 32 and other.num_cached_tokens >= 32
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    eng.kv.pool.reset_prefix_cache()
    cold = llm_fp32.generate(shared + "Name a color.", params)[0]
    assert cold.num_cached_tokens == 0
    assert other.outputs[0].token_ids == cold.outputs[0].token_ids


def test_chunked_prefill_and_preemption_keep_tokens(model_path, llm_fp32):
    from engine_core.llm import LLM

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [p * 6 for p in PROMPTS]
    expected = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, params)]
    # a 16-token budget chunks every prompt; 14 blocks cannot hold all five sequences,
    # so running requests get preempted and recomputed
    small = LLM(str(model_path), dtype="float32", num_kv_blocks=14,
                max_num_batched_tokens=16, enable_prefix_caching=False,
                quantize_decode=False)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert small.engine.kv.num_free_blocks == 14


def test_seeded_sampling_is_reproducible_in_any_batch(llm_fp32):
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm_fp32.generate(PROMPTS[0], sp)[0].outputs[0].token_ids
    crowd = llm_fp32.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        [SamplingParams(max_tokens=20, temperature=1.0), sp, SamplingParams(max_tokens=5)],
    )[1].outputs[0].token_ids
    assert alone == crowd


def test_stop_strings_stop_tokens_and_logprobs(llm_fp32):
    base = llm_fp32.generate(PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0))[0]
    text = base.outputs[0].text
    word = text.split()[3]
    out = llm_fp32.generate(PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0,
                                                        stop=[word]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.text == text[: text.index(word)]
    base_ids = base.outputs[0].token_ids
    tok = base_ids[5]
    out = llm_fp32.generate(PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0,
                                                        stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == base_ids[: base_ids.index(tok) + 1] and out.stop_reason == tok
    # the stop token's id ends token_ids, its text is not output (vLLM's way), whether or not
    # special tokens are skipped; so is EOS's, which only kept special tokens would show
    tokenizer = llm_fp32.tokenizer
    assert out.text == tokenizer.decode(base_ids[: base_ids.index(tok)])
    chat = llm_fp32.chat([[{"role": "user", "content": "Say hi."}]],
                         SamplingParams(max_tokens=60, temperature=0.0,
                                        skip_special_tokens=False))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in tokenizer.eos_token_ids
    assert chat.text == tokenizer.decode(chat.token_ids[:-1], skip_special_tokens=False)
    assert "<|im_end|>" not in chat.text
    out = llm_fp32.generate(PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0,
                                                        logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top one
        assert max(entry.values()) == pytest.approx(entry[token])


def test_chat_answers_paris(model_path):
    from engine_core.llm import LLM

    llm = LLM(kv_cache_memory_gb=0.1)  # the default model (already pulled) and dtype
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in out[0].outputs[0].text
