"""The whole engine on the Triton kernels, on CPU through the Triton interpreter: what runs on
a GPU, checked where there is none. A tiny random Llama (tests/tiny_model.py) so that the
interpreter's speed doesn't matter.

Each engine runs in a fresh process: the interpreter must be on before triton is imported
(tests/kernels/conftest.py), and PDSERVE_NATIVE=0 keeps the C kernels out of the way so that
every attention call goes to the backend under test (kernels/backends.py). Greedy output
on the Triton backend must equal the torch backend's and transformers'. This catches
metadata, stride, dtype and block-table mistakes between the engine and the kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.e2e.stack import (
    STARTUP_TIMEOUT_S,
    UP_READY,
    Stack,
    check_word_completions,
    stop_stack,
)
from tests.helpers import ROOT, spawn_pdserve, wait_for_output
from tests.tiny_model import words, write_tiny_llama

pytestmark = pytest.mark.slow

# a prompt longer than a block, one of several blocks, one sharing a prefix with it (the
# prefix cache hands the second its blocks), and a 1-token one
PROMPTS = [[5, 9, 200, 31] * 5, list(range(3, 60)), list(range(3, 40)) + [7, 7], [11]]
MAX_TOKENS = 12
CHUNK = 32  # max_num_batched_tokens: the 57-token prompt is prefilled in two chunks

SCRIPT = """
import json, os, sys
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.helpers import count_split_combines
triton = os.environ["PDSERVE_ATTN_BACKEND"] == "triton"
combines = count_split_combines() if triton else []  # the split decodes' combines
llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", quantize_decode=False,
          max_num_batched_tokens=int(sys.argv[2]), kv_cache_memory_gb=0.05)
prompts = json.loads(sys.argv[3])
params = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0.0, ignore_eos=True)
first = llm.generate(prompts[:1], params)  # then the rest, the first's blocks now cached
rest = llm.generate(prompts[1:], params)
triton_modules = sorted(m for m in ("kernels.decode_attention", "kernels.prefill_attention",
                                    "kernels.store_kv_triton") if m in sys.modules)
print(json.dumps({"ids": [o.outputs[0].token_ids for o in first + rest],
                  "triton_modules": triton_modules, "combines": len(combines)}))
"""
TRITON_MODULES = ["kernels.decode_attention", "kernels.prefill_attention",
                  "kernels.store_kv_triton"]  # imported when the engine selects triton


def backend_env(backend: str) -> dict[str, str]:
    return {"PDSERVE_NATIVE": "0", "PDSERVE_ATTN_BACKEND": backend, "TRITON_INTERPRET": "1",
            "PDSERVE_CHECK_DEVICE": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def offline(tiny, backend: str) -> list[list[int]]:
    """Offline greedy ids. On the Triton backend each decode context is split in 3 (flash
    decoding, which a card uses for grids under one wave; auto never splits on a CPU), so the
    split kernels and their combine run inside the engine here; `pdserve up` below runs the
    unsplit kernel."""
    prompts = [words(p) for p in PROMPTS]
    splits = {"PDSERVE_DECODE_SPLITS": "3"} if backend == "triton" else {}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny), str(CHUNK), json.dumps(prompts),
         str(MAX_TOKENS)], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, **backend_env(backend), **splits})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["triton_modules"] == (TRITON_MODULES if backend == "triton" else [])
    if backend == "triton":  # every decode step's layers split: 2 layers x 12 tokens at least
        assert result["combines"] >= 2 * MAX_TOKENS, result["combines"]
    return result["ids"]


@pytest.fixture(scope="module")
def triton_offline(tiny) -> list[list[int]]:
    return offline(tiny, "triton")


def transformers_greedy(tiny, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_triton_backend_equals_torch_backend_and_transformers(tiny, triton_offline):
    assert triton_offline == offline(tiny, "torch")
    for prompt, ids in zip(PROMPTS, triton_offline, strict=True):
        assert ids == transformers_greedy(tiny, prompt)


def test_pdserve_up_on_the_triton_backend_over_grpc(tiny, triton_offline):
    proc, log = spawn_pdserve(
        "up", "--port", "0", "--http-port", "0", "--kv-cache-memory-gb", "0.05",
        "--model", str(tiny), "--dtype", "float32", "--transport", "grpc",
        name="up-triton", env=backend_env("triton"))
    m = wait_for_output(proc, log, UP_READY, STARTUP_TIMEOUT_S, "pdserve up")
    stack = Stack(proc, log, m.group(1), m.group(2), m.group(3).split(), m.group(4).split(),
                  m.group(5).split())
    try:
        check_word_completions(stack, PROMPTS, triton_offline, MAX_TOKENS)
    finally:
        assert stop_stack(stack) == 0


ARCH_SCRIPT = """
import json, sys
from pathlib import Path
from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import CASES
config_cls, overrides = CASES[sys.argv[1]]
hf = tm.build_hf(config_cls, Path(sys.argv[2]), **overrides)
eng = tm.engine(Path(sys.argv[2]), max_num_batched_tokens=16)
prompts = tm.prompts(tm.SIZES["vocab_size"], [9, 40])
print(json.dumps({"ours": tm.greedy(eng, prompts, 8),
                  "transformers": [tm.hf_greedy(hf, p, 8) for p in prompts],
                  "triton": "kernels.decode_attention" in sys.modules,
                  "fused_moe": "kernels.fused_moe" in sys.modules}))
"""


@pytest.mark.parametrize("case", ["gpt-oss", "qwen3-moe"])
def test_newer_architecture_on_the_triton_kernels(case, tmp_path):
    """Tiny random models on the Triton backend, each decode context split in 3 and the
    prompts chunked by 16: greedy equal to transformers'. GPT-OSS (windowed and global
    layers, attention sinks, biased experts), so the sinks reach the kernels a card runs;
    both mixtures of experts through the grouped expert matmuls (kernels/fused_moe.py),
    Qwen3-MoE's first layer a dense MLP beside them."""
    out = subprocess.run(
        [sys.executable, "-c", ARCH_SCRIPT, case, str(tmp_path)], cwd=ROOT,
        capture_output=True, text=True, timeout=600,
        env={**os.environ, **backend_env("triton"), "PDSERVE_DECODE_SPLITS": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["triton"] and result["fused_moe"]
    assert result["ours"] == result["transformers"]
