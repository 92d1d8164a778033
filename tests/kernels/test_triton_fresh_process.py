"""Reruns the Triton tests in a fresh process when this one cannot run them.

That happens when something imported triton before tests/kernels/conftest.py could set
TRITON_INTERPRET=1 (see there). The fresh process sets it before anything is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parents[1]


def test_triton_kernels_in_fresh_process(triton_unavailable: str | None) -> None:
    if triton_unavailable is None:
        pytest.skip("the Triton tests ran in this process")
    if "not installed" in triton_unavailable:
        pytest.skip(triton_unavailable)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", str(TESTS_DIR), "-q", "-p", "no:cacheprovider"]
    command += ["-k", "triton and not fresh_process"]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
