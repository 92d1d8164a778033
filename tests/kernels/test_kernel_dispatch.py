"""The one selection of attention kernels (kernels/backends.py), made once per engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.backends import BACKEND_ENV, attention_kernels, select_backend

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_backend_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton on CUDA; the C kernels on CPU where they load, else torch; PDSERVE_ATTN_BACKEND
    overrides (any case, spaces around it), and native is refused off the CPU."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(torch.device("cuda", 0)) == "triton"
    want_cpu = "native" if native.load() is not None else "torch"
    assert select_backend(torch.device("cpu")) == want_cpu
    for value in ("triton", "torch", " Triton "):
        monkeypatch.setenv(BACKEND_ENV, value)
        assert select_backend(torch.device("cpu")) == value.strip().lower()
        assert select_backend(torch.device("cuda", 0)) == value.strip().lower()
    monkeypatch.setenv(BACKEND_ENV, "native")
    assert select_backend(torch.device("cpu")) == "native"
    with pytest.raises(ValueError, match="native is the CPU's C kernels"):
        select_backend(torch.device("cuda", 0))


def test_env_rejects_unknown_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=f"{BACKEND_ENV} must be one of"):
        select_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="attention backend must be one of"):
        attention_kernels("cuda")


def test_each_backend_names_its_kernels() -> None:
    torch_kernels = attention_kernels("torch")
    assert (torch_kernels.name, torch_kernels.lib) == ("torch", None)
    if native.load() is not None:
        c = attention_kernels("native")
        assert c.name == "native" and c.lib is native.load()
        assert c.store_kv is torch_kernels.store_kv  # what the C rows cannot take


def test_compiled_kernel_refuses_cpu_tensors() -> None:
    pytest.importorskip("triton")
    from kernels.triton_utils import launchable

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launchable(object(), torch.device("cpu"))


def test_torch_path_does_not_import_triton() -> None:
    """The CPU path must work, and stay cheap to import, without triton: an engine on the
    torch or native kernels never imports it."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        from engine_core.platforms import select_platform
        from tests.kernels.attention_inputs import make_decode_inputs

        platform = select_platform("cpu")
        inputs = make_decode_inputs([3, 9], 4, 2, 16, 8, torch.float32)
        platform.kernels.decode(*inputs.args())
        assert "triton" not in sys.modules, "torch path imported triton"
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
