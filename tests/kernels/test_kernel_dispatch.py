"""Backend selection of the public kernel API."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.dispatch import BACKEND_ENV, select_backend

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cpu_defaults_to_torch_and_cuda_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(torch.device("cpu")) == "torch"
    assert select_backend(torch.device("cuda", 0)) == "triton"


@pytest.mark.parametrize("value", ["triton", "torch", " Triton "])
def test_env_forces_backend(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(BACKEND_ENV, value)
    assert select_backend(torch.device("cpu")) == value.strip().lower()


def test_env_rejects_unknown_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_backend(torch.device("cpu"))


def test_compiled_kernel_refuses_cpu_tensors() -> None:
    pytest.importorskip("triton")
    from kernels.triton_utils import launchable

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        launchable(object(), torch.device("cpu"))


def test_torch_path_does_not_import_triton() -> None:
    """The CPU path must work, and stay cheap to import, without triton."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        from kernels import paged_decode_attention, paged_prefill_attention, store_kv
        from tests.kernels.attention_inputs import make_decode_inputs

        inputs = make_decode_inputs([3, 9], 4, 2, 16, 8, torch.float32)
        paged_decode_attention(*inputs.args())
        assert "triton" not in sys.modules, "torch path imported triton"
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_backend_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/backends.py: triton on CUDA; the C kernels on CPU where they load, else torch;
    PDSERVE_ATTN_BACKEND overrides, and native is refused off the CPU."""
    from kernels import native
    from kernels.backends import attention_backend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert attention_backend(torch.device("cuda", 0)) == "triton"
    want_cpu = "native" if native.load() is not None else "torch"
    assert attention_backend(torch.device("cpu")) == want_cpu
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert attention_backend(torch.device("cpu")) == "torch"
    assert select_backend(torch.device("cuda", 0)) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "native")
    assert attention_backend(torch.device("cpu")) == "native"
    assert select_backend(torch.device("cpu")) == "torch"  # native is not a per-call backend
    with pytest.raises(ValueError, match="native is the CPU's C kernels"):
        attention_backend(torch.device("cuda", 0))
