"""The platform an engine runs on (engine_core/platforms/), chosen once: what it decides, and
that nothing else in engine_core decides by device or by which kernels loaded."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from engine_core.llm import LLM
from engine_core.platforms import select_platform
from engine_core.platforms.cpu import CpuPlatform, cpu_default_dtype
from engine_core.sampling_params import SamplingParams
from kernels import native
from kernels.backends import BACKEND_ENV
from tests.helpers import ROOT
from tests.tiny_model import write_tiny_llama

# a device-type or native-availability check: `.type == "cpu"`, `.is_cuda`,
# `torch.cuda.is_available()`, `native.load()`, `native.has_int8(...)`
CHECK = re.compile(r"\.type\s*(==|!=|in\b)|\.is_cuda\b|cuda\.is_available\(|native\.(load|has_)")


def test_no_device_or_native_checks_in_engine_core_outside_the_platforms():
    found = []
    for path in sorted((ROOT / "engine_core").rglob("*.py")):
        if "platforms" in path.relative_to(ROOT / "engine_core").parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if CHECK.search(code):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_the_cpu_platform_and_its_kernels(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    cpu = select_platform("cpu")
    assert isinstance(cpu, CpuPlatform) and cpu.device == torch.device("cpu")
    assert cpu.kernels.name == ("native" if native.load() is not None else "torch")
    assert cpu.resolve_dtype(None) == cpu.resolve_dtype("auto") == cpu_default_dtype()
    assert cpu.resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        cpu.resolve_dtype("float8")
    assert not (cpu.pin_memory or cpu.cuda_graphs or cpu.async_scheduling)
    assert cpu.graphs_refusal(False) == "eager (no CUDA graphs on cpu)"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_platform("cpu").kernels.name == "torch"
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        select_platform("meta")


def test_the_backend_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    with caplog.at_level(logging.INFO, logger="engine_core.platforms"):
        select_platform("cpu")
        select_platform("cpu")
    assert sum("attention on the torch kernels" in r.message for r in caplog.records) <= 1


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_the_platform_builds_the_model_with_its_kernels(tmp_path, monkeypatch, backend):
    """The model's modules get the platform's kernels at construction (model/ops.py): the C
    rows' attention (and a float32 model's fused norms) on the native backend, none of them
    on torch's."""
    if backend == "native" and native.load() is None:
        pytest.skip("the C kernels do not load here")
    monkeypatch.setenv(BACKEND_ENV, backend)
    tiny = write_tiny_llama(tmp_path)
    llm = LLM(model=str(tiny), dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
    layer = llm.engine.model.layers[0]
    c = backend == "native"
    assert (layer.self_attn.row_attention is not None) == c
    assert (layer.input_layernorm.fused is not None) == c
    assert (llm.engine.model.norm.fused is not None) == c
    assert llm.engine.platform.kernels.name == backend
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [out] = llm.generate([[5, 9, 200, 31, 7]], params)
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize(("first", "env", "too_late"), [
    ("import torch; ", {}, True),  # libgomp loaded before the count was set: its default
    ("", {}, False),
    ("import torch; ", {"GOMP_SPINCOUNT": "5"}, False),  # the user's own value
])
def test_the_openmp_spin_count_set_too_late_is_noticed(first, env, too_late):
    import os
    import subprocess
    import sys

    code = f"{first}from engine_core import openmp_env as o; print(o.SPIN_SET_TOO_LATE)"
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**base, **env}, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == str(too_late)


def test_a_cpu_engine_warns_once_when_the_spin_count_came_too_late(monkeypatch, caplog):
    from engine_core import openmp_env
    from engine_core.platforms import cpu

    monkeypatch.setattr(openmp_env, "SPIN_SET_TOO_LATE", True)
    cpu._warn_if_spin_set_too_late.cache_clear()
    said = _warnings_of_two_platforms(caplog, "GOMP_SPINCOUNT=3000")
    assert len(said) == 1 and "torch was imported before engine_core" in said[0]
    cpu._warn_if_spin_set_too_late.cache_clear()


def test_a_cpu_engine_warns_once_when_float32_rows_vary(monkeypatch, caplog):
    """MKL multiplied before engine_core set MKL_CBWR (platforms/cpu/prefill_matmuls.py)."""
    from engine_core.platforms import cpu

    monkeypatch.setattr(cpu, "float32_rows_vary", lambda: True)
    cpu._warn_if_float32_rows_vary.cache_clear()
    said = _warnings_of_two_platforms(caplog, "MKL_CBWR=AUTO,STRICT")
    assert len(said) == 1 and "float32 prompts' KV depends" in said[0]
    cpu._warn_if_float32_rows_vary.cache_clear()


def _warnings_of_two_platforms(caplog, needle: str) -> list[str]:
    """Build two CPU platforms; the warnings they logged that contain `needle`."""
    with caplog.at_level(logging.WARNING, logger="engine_core.platforms.cpu"):
        CpuPlatform(torch.device("cpu"))
        CpuPlatform(torch.device("cpu"))
    return [r.message for r in caplog.records if needle in r.message]
