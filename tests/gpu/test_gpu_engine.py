"""The engine on CUDA (the Triton kernels compiled for the card), against transformers on the
same card: offline, and served by `pdserve up` over grpc and cuda_ipc. Skipped without CUDA."""

from __future__ import annotations

import httpx2 as httpx
import pytest
import torch

from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.e2e.stack import check_word_completions, spawn_stack, stop_stack, wait_stack
from tests.tiny_model import words, write_tiny_llama

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 200, 31], list(range(3, 70)), [(7 * i) % 500 + 3 for i in range(300)]]
MAX_TOKENS = 24


@pytest.fixture(autouse=True)
def _check_device(monkeypatch):
    """Every engine step here asserts it computes on the card (engine_core/platforms/device_check.py)."""
    monkeypatch.setenv("PDSERVE_CHECK_DEVICE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def hf_greedy(folder, dtype: torch.dtype, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    x = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(folder, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()
    with torch.inference_mode():
        return model(torch.tensor([ids], device="cuda")).logits[0].float()


def transfers_by_transport(metrics_url: str) -> dict[str, int]:
    """The prefill worker's count of KV transfers, by the transport each used (non-zero)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            if sample.name.endswith("kv_transfer_time_seconds_count") and sample.value:
                counts[sample.labels["transport"]] = int(sample.value)
    return counts


def engine_greedy(folder, dtype: str) -> list[list[int]]:
    llm = LLM(model=str(folder), dtype=dtype, device="cuda", kv_cache_memory_gb=0.25)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([words(p) for p in PROMPTS], params)
    assert llm.engine.runner.kv_cache.is_cuda
    return [o.outputs[0].token_ids for o in outs]


def test_engine_on_a_second_card_stepped_from_another_thread(tiny):
    """On cuda:N, N > 0, stepped from a thread whose current device is 0: Triton launches,
    events and streams take the current device unless told, so the engine makes its own
    current (a multi-GPU node; the lent machines have one card, where this skips)."""
    import threading

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    device = f"cuda:{torch.cuda.device_count() - 1}"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    result: dict = {}

    def run() -> None:
        assert torch.cuda.current_device() == 0
        llm = LLM(model=str(tiny), dtype="float32", device=device, kv_cache_memory_gb=0.25)
        outs = llm.generate([words(p) for p in PROMPTS], params)
        result["ids"] = [o.outputs[0].token_ids for o in outs]
        result["cache"] = llm.engine.runner.kv_cache.device

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert str(result["cache"]) == device
    assert result["ids"] == engine_greedy(tiny, "float32")


def test_float32_greedy_equals_transformers_on_cuda(tiny):
    got = engine_greedy(tiny, "float32")
    for prompt, ids in zip(PROMPTS, got, strict=True):
        assert ids == hf_greedy(tiny, torch.float32, prompt)


def test_bfloat16_greedy_tokens_are_transformers_argmax_on_cuda(tiny):
    """bf16 rounding differs between our kernels and transformers', so a near-tie may flip;
    teacher-forced, every token we chose must be transformers' argmax or within bf16 noise of
    it (a wrong kernel, stride or block table misses by whole logits)."""
    got = engine_greedy(tiny, "bfloat16")
    exact = 0
    for prompt, ids in zip(PROMPTS, got, strict=True):
        logits = hf_logits(tiny, torch.bfloat16, prompt + ids)[len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(ids, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert gap.max().item() <= 0.125, (ids, gap.tolist())
        exact += int(ids == hf_greedy(tiny, torch.bfloat16, prompt))
    assert exact >= 1  # and at least one whole continuation equal


@pytest.mark.parametrize("transport", ["grpc", "cuda_ipc"])
def test_pdserve_up_on_cuda_equals_offline(tiny, transport):
    want = engine_greedy(tiny, "bfloat16")
    proc, log = spawn_stack("--model", str(tiny), "--transport", transport)
    stack = wait_stack(proc, log)
    try:
        check_word_completions(stack, PROMPTS, want, MAX_TOKENS, timeout=120)
        assert transfers_by_transport(stack.metrics[1]) == {transport: len(PROMPTS)}
    finally:
        assert stop_stack(stack) == 0


def test_sampled_requests_on_cuda_are_reproducible_and_follow_their_filters(tiny):
    """Sampling on the card: the rows' parameters reach the device, seeded rows draw from
    their own (host) generators, penalties apply there."""
    llm = LLM(model=str(tiny), dtype="bfloat16", device="cuda", kv_cache_memory_gb=0.25)
    prompts = [words(p) for p in PROMPTS]
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, top_k=20,
                            seed=7, repetition_penalty=1.2, presence_penalty=0.5,
                            ignore_eos=True)
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, min_p=0.05,
                           frequency_penalty=0.3, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, [seeded, plain, seeded])]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], seeded)]
    assert again[0] == first[0]  # a seeded request alone equals itself in a batch
    assert all(len(ids) == MAX_TOKENS for ids in first)
    one = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert (llm.generate(prompts[:1], one)[0].outputs[0].token_ids
            == llm.generate(prompts[:1], greedy)[0].outputs[0].token_ids)  # top_k=1 is argmax


def test_bench_engine_on_the_card(tiny, tmp_path):
    """`pdserve bench-engine --device cuda`: the engine and transformers both on the card."""
    import json

    from pdserve.bench_engine import run
    from pdserve.cli import build_parser

    args = build_parser().parse_args([
        "bench-engine", "--model", str(tiny), "--device", "cuda", "--concurrency", "1", "8",
        "--prompt-len", "32", "--output-len", "16", "--repeats", "1", "--hf-requests", "1",
        "--out", str(tmp_path),
    ])
    assert run(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["device"].startswith("cuda") and results["gpu"]
    assert results["dtype"] == "bfloat16" and results["transformers_dtype"] == "bfloat16"
    assert [r["concurrency"] for r in results["engine"]] == [1, 8]
    assert all(r["output_tokens_per_s"] > 0 for r in results["engine"])


@pytest.mark.parametrize("case", ["gemma3", "qwen3-moe", "gpt-oss", "olmo3"])
def test_architectures_on_cuda_match_transformers(case, tmp_path):
    """Windowed layers with their own rope (Gemma 3), experts (Qwen3-MoE), sinks with experts
    and biases (GPT-OSS), post-norms and whole-width q/k norms (OLMo 3), on the card's Triton
    kernels in float32: logits and greedy tokens
    equal to transformers' (tests/engine_core/arch_cases.py; transformers on the host)."""
    from tests.engine_core import tiny_models as tm
    from tests.engine_core.arch_cases import CASES, check_against_hf

    config_cls, overrides = CASES[case]
    check_against_hf(tm.build_hf(config_cls, tmp_path, **overrides), tmp_path, device="cuda")
