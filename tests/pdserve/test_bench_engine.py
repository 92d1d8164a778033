"""`pdserve bench-engine` end to end on the real model, kept small: an untimed round, then
timed rounds of each concurrency and transformers beside them; medians reported, every run
kept, each ratio taken within its round."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.bench_engine import make_prompts, parse_sampling, run
from pdserve.cli import build_parser


def test_bench_engine_reports_the_median_of_its_repeats(tmp_path, model_path):
    args = build_parser().parse_args([
        "bench-engine", "--model", str(model_path), "--concurrency", "1", "3",
        "--prompt-len", "24", "--output-len", "5", "--repeats", "3", "--hf-requests", "1",
        "--out", str(tmp_path),
    ])
    assert run(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["concurrency"] for r in results["engine"]] == [1, 3]
    for r in results["engine"]:
        runs = r["runs_tokens_per_s"]
        assert len(runs) == 3 and all(x > 0 for x in runs)
        assert r["output_tokens_per_s"] == sorted(runs)[1]
        assert r["steps"] >= 5  # one token per step at least after the prefill
        hf_runs = results["transformers"]["runs_tokens_per_s"]
        ratios = [e / h for e, h in zip(runs, hf_runs, strict=True)]
        assert r["ratios_vs_transformers"] == sorted(ratios)
        assert r["ratio_vs_transformers"] == sorted(ratios)[1]
        assert len(r["cpu_ratios_vs_transformers"]) == 3
        assert r["cpu_ratio_vs_transformers"] == r["cpu_ratios_vs_transformers"][1] > 0
    assert len(results["transformers"]["runs_tokens_per_s"]) == 3
    assert results["transformers"]["output_tokens_per_cpu_s"] > 0
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_bench_prompts_differ_between_runs(offline):
    tok = offline.tokenizer
    first, second = make_prompts(tok, 3, 32), make_prompts(tok, 3, 32, first=3)
    assert all(len(p) == 32 for p in first + second)
    # every prompt's first block differs from every other's: no run reuses another's prefix
    assert len({tuple(p[:16]) for p in first + second}) == 6


def test_bench_engine_times_sampled_settings_beside_greedy(tmp_path, model_path):
    args = build_parser().parse_args([
        "bench-engine", "--model", str(model_path), "--concurrency", "2",
        "--prompt-len", "24", "--output-len", "5", "--repeats", "2", "--skip-hf",
        "--sampling", "greedy", "temperature=1.0,top_p=0.95",
        "temperature=0.7,top_k=50,repetition_penalty=1.1", "--out", str(tmp_path),
    ])
    assert run(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    engine = results["engine"]
    assert [r["sampling"] for r in engine] == [
        "greedy", "temperature=1.0,top_p=0.95", "temperature=0.7,top_k=50,repetition_penalty=1.1"]
    greedy_runs = engine[0]["runs_tokens_per_s"]
    assert "ratio_vs_greedy" not in engine[0]
    for r in engine[1:]:  # each round's sampled run against that round's greedy run
        ratios = [s / g for s, g in zip(r["runs_tokens_per_s"], greedy_runs, strict=True)]
        assert r["ratios_vs_greedy"] == sorted(ratios)
        assert r["ratio_vs_greedy"] == sorted(ratios)[1]
        assert len(r["cpu_ratios_vs_greedy"]) == 2 and r["cpu_ratio_vs_greedy"] > 0


def test_sampling_specs_parse_and_bad_ones_name_the_field():
    assert parse_sampling("greedy") == {"temperature": 0.0}
    assert parse_sampling("temperature=0.7,top_k=50,repetition_penalty=1.1") == {
        "temperature": 0.7, "top_k": 50, "repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\], got 1.5"):
        parse_sampling("temperature=1,top_p=1.5")
    with pytest.raises(ValueError, match="names among temperature"):
        parse_sampling("temp=1")
    with pytest.raises(ValueError, match="top_k must be an integer, got '5.5'"):
        parse_sampling("top_k=5.5")


def test_bench_engine_on_a_safetensors_folder_names_its_device(tmp_path):
    """A model folder (not a GGUF) works on both sides; the results name the device both ran
    on, which --device chooses for the engine and transformers alike."""
    from tests.tiny_model import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "tiny")
    args = build_parser().parse_args([
        "bench-engine", "--model", str(folder), "--device", "cpu", "--dtype", "float32",
        "--concurrency", "2", "--prompt-len", "16", "--output-len", "4", "--repeats", "1",
        "--hf-requests", "1", "--out", str(tmp_path / "out"),
    ])
    assert run(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert (results["device"], results["gpu"]) == ("cpu", None)
    assert results["transformers"]["output_tokens_per_s"] > 0
    [engine] = results["engine"]
    assert engine["concurrency"] == 2 and engine["ratio_vs_transformers"] > 0


@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: torch sees no CUDA device here"),
    ("mps", "--device must be cpu or cuda (cuda:N), got 'mps'"),
    ("gpu0", "--device must be cpu or cuda (cuda:N), got 'gpu0'"),
])
def test_bench_engine_refuses_a_device_it_cannot_use(tmp_path, device, message):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = build_parser().parse_args(["bench-engine", "--device", device,
                                      "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=re.escape(message)):
        run(args)
