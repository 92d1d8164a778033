"""Shared fixtures: the real default model (fetched from PyPI once), engines and the
transformers reference built from the same GGUF."""

from __future__ import annotations

import pytest
import torch


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
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return model.eval()
