"""End to end on the real model: the harness starts a colocated gateway and the naive server
(servers.launch), `pdserve bench` runs a tiny load against each over both protocols, and the
naive server streams the same greedy text as our engine."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest

from pdserve.bench.servers import Server, StackOptions
from pdserve.cli import main

NUM_PROMPTS = 4
OUTPUT_LEN = 8
READY_TIMEOUT_S = 300  # two cores shared with whatever else runs


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    """Both servers load at the same time (each takes 20-40 s here); the naive one on one
    thread, so that it does not crawl when the other core is busy (OpenMP threads wait on
    each other)."""
    logs = tmp_path_factory.mktemp("logs")
    started = []
    try:
        started.append(Server("colocated", StackOptions(
            model=str(model_path), dtype="float32",
            colocated_args=("--kv-cache-memory-gb", "0.5")), logs))
        started.append(Server("naive", StackOptions(model=str(model_path),
                                                    naive_args=("--threads", "1")), logs))
        yield {s.target.name: s.wait_healthy(READY_TIMEOUT_S) for s in started}
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def colocated(servers):
    return servers["colocated"]


@pytest.fixture(scope="module")
def naive(servers):
    return servers["naive"]


def bench(out: Path, *flags: str) -> dict:
    assert main(["bench", "--workload", "fixed", "--input-len", "16", "--output-len",
                 str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--out", str(out),
                 *flags]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(("protocol", "api"), [("grpc", "completions"), ("http", "chat")])
def test_bench_a_running_gateway(colocated, tmp_path, protocol, api):
    summary = bench(tmp_path, "--gateway", colocated.grpc_address, "--base-url",
                    colocated.http_url, "--protocol", protocol, "--label", "colocated",
                    "--concurrency", "2", "--api", api, "--temperature", "0")
    assert set(summary["backends"]) == {"colocated"}
    point = json.loads((tmp_path / "colocated-c2.json").read_text())
    assert point["endpoint_type"] == protocol and point["model_id"] == "SmolLM2-135M-Instruct"
    assert (point["completed"], point["failed"], point["incomplete"]) == (NUM_PROMPTS, 0, 0)
    assert point["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos
    if api == "completions":
        assert point["input_lens"] == [16] * NUM_PROMPTS  # the server's count of our prompt
    else:  # the same text as the user's message: the chat template's tokens come on top
        assert all(n > 16 for n in point["input_lens"])
    # the server's timing breakdown: every request prefilled by the colocated engine
    assert point["num_timed"] == NUM_PROMPTS and point["prefill_colocated_share"] == 1.0
    assert 0 < point["median_prefill_ms"] < point["p99_ttft_ms"]
    assert all(0 < t < 60 for t in point["ttfts"])
    itls = [x for itl in point["itls"] for x in itl]
    if protocol == "grpc":  # every token is timed; over SSE held-back text merges events
        assert all(len(itl) == OUTPUT_LEN - 1 for itl in point["itls"])
    assert itls and all(0 <= x < 30 for x in itls) and point["mean_itl_ms"] > 0
    assert 0 < point["p50_tpot_ms"] <= point["p99_tpot_ms"]
    assert point["p50_e2el_ms"] > point["p50_ttft_ms"] > 0
    assert point["output_throughput"] > 0 and point["errors"] == [""] * NUM_PROMPTS
    for png in ("latency.png", "throughput.png"):
        assert (tmp_path / png).stat().st_size > 10_000


def test_multi_turn_chats_carry_their_history(colocated, tmp_path):
    summary = bench(tmp_path, "--gateway", colocated.grpc_address, "--label", "colocated",
                    "--workload", "multi-turn", "--num-prompts", "2", "--concurrency", "2")
    point = summary["backends"]["colocated"]["2"]
    turns = point["groups"]["first-turn"]["completed"] + point["groups"]["follow-up"]["completed"]
    assert point["groups"]["first-turn"]["completed"] == 2 and 8 <= turns <= 16
    assert point["failed"] == point["incomplete"] == 0
    lens = json.loads((tmp_path / "colocated-c2.json").read_text())["input_lens"]
    assert max(lens) > 2 * min(lens)  # later turns hold the earlier answers


def test_naive_server_is_capped_and_says_so(naive, tmp_path):
    summary = bench(tmp_path, "--base-url", naive.http_url, "--label", "naive",
                    "--concurrency", "2", "--naive-max-requests", "2")
    point = summary["backends"]["naive"]["2"]
    assert (point["num_prompts"], point["completed"], point["failed"]) == (2, 2, 0)
    assert any("at most 2 requests" in note for note in summary["notes"])


def stream_text(base_url: str, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    texts = []
    with httpx.Client(base_url=base_url, timeout=120) as http, \
            http.sse("/v1/completions", method="POST", json=body) as events:
        for event in events:
            if event.data != "[DONE]":
                texts += [c["text"] for c in event.json()["choices"]]
    return "".join(texts)


def test_naive_server_streams_the_engines_greedy_text(colocated, naive):
    # both float32 and greedy from the same GGUF: transformers' dequantized weights and our
    # engine (its decode rows on the GGUF's own 4-bit blocks) pick the same tokens
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci"
    assert stream_text(naive.http_url, prompt, 8) == stream_text(colocated.http_url, prompt, 8)
