"""The result files and the side-by-side table; how the harness starts, waits for and stops
its servers; the `pdserve bench` flags."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine_core.config import dtype_name
from engine_core.platforms import resolve_dtype
from pdserve.bench import report
from pdserve.bench.command import configs
from pdserve.bench.metrics import SLO, RequestResult
from pdserve.bench.servers import StackOptions, Target, command, stop, wait_healthy
from pdserve.cli import build_parser

VLLM_KEYS = {
    "date", "backend", "model_id", "num_prompts", "request_rate", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "errors",
} | {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p90", "p99")
     for m in ("ttft", "tpot", "itl", "e2el")}


def point(backend: str, seconds_per_token: float, groups=("main",)) -> dict:
    results = [RequestResult(group=g, is_success=True, input_len=10, output_len=5,
                             ttft=seconds_per_token, latency=5 * seconds_per_token,
                             itl=[seconds_per_token] * 4) for g in groups for _ in range(4)]
    return report.point_result(backend=backend, protocol="http", model_id="m",
                               workload="fixed", max_concurrency=2, request_rate=float("inf"),
                               results=results, duration_s=2.0, slo=SLO(1000, 100))


def test_point_has_vllm_keys_and_groups_for_mixed():
    p = point("colocated", 0.05)
    assert set(p) >= VLLM_KEYS
    assert p["request_rate"] == "inf" and "groups" not in p
    mixed = point("colocated", 0.05, groups=("decode", "long"))
    assert set(mixed["groups"]) == {"decode", "long"}
    assert mixed["groups"]["decode"]["completed"] == 4 and mixed["completed"] == 8


def test_table_and_summary_compare_to_naive():
    points = {"naive": {2: point("naive", 0.1)}, "colocated": {2: point("colocated", 0.05)}}
    text = report.table(points)
    assert "colocated/naive" in text
    rows = {line[:22].strip(): line for line in text.splitlines()}  # label column: 22 wide
    assert rows["TTFT p50 ms"].split()[-1] == "0.50x"  # half the naive TTFT
    assert rows["output tok/s"].split()[-1] == "1.00x"  # same tokens in the same time
    assert not rows["completed"].endswith("x")  # counts get no ratio
    s = report.summary(points, ["a note"], {"workload": "fixed"})
    assert s["ratios"]["colocated/naive"]["2"]["TTFT p50 ms"] == pytest.approx(0.5)
    assert "ttfts" not in s["backends"]["naive"]["2"]  # per-request lists stay in the points
    mixed = {"naive": {1: point("naive", 0.1, ("decode", "long"))},
             "disagg": {1: point("disagg", 0.02, ("decode", "long"))}}
    assert "decode ITL p99 ms" in report.table(mixed)


def test_sampled_vs_greedy_and_conditional_vs_always_remote(tmp_path):
    from pdserve.bench.plots import plot_curve

    points = {"colocated": {1: point("colocated", 0.02), 8: point("colocated", 0.04)},
              "colocated-greedy": {1: point("colocated-greedy", 0.02),
                                   8: point("colocated-greedy", 0.03)}}
    assert report.comparisons(list(points)) == [("colocated", "colocated-greedy")]
    rows = {line[:22].strip(): line for line in report.table(points).splitlines()}
    assert "colocated/colocated-greedy" in report.table(points)
    assert rows["TTFT p50 ms"].split()[-1] == "1.33x"  # at c=8 (the last block): 40 / 30
    s = report.summary(points, [], {})
    assert s["ratios"]["colocated/colocated-greedy"]["1"]["TTFT p50 ms"] == pytest.approx(1)
    plot_curve(points, tmp_path / "curve.png", "curve")
    png = (tmp_path / "curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000
    # the prefill policies: conditional against always-remote; the server's timing as rows
    timed = [RequestResult(is_success=True, output_len=2, ttft=0.1, latency=0.2, itl=[0.1],
                           timing={"queue_s": q, "prefill_s": 0.02, "prefill_where": w})
             for q, w in ((0.01, "local"), (0.03, "remote"), (0.05, "local"))]
    policies = {b: {4: report.point_result(
        backend=b, protocol="grpc", model_id="m", workload="multi-turn", max_concurrency=4,
        request_rate=float("inf"), results=timed, duration_s=1.0, slo=SLO())}
        for b in ("conditional", "always-remote", "colocated")}
    p = policies["conditional"][4]
    assert p["median_queue_ms"] == pytest.approx(30) and p["median_prefill_ms"] == 20
    assert p["prefill_local_share"] == pytest.approx(2 / 3) and p["num_timed"] == 3
    assert report.comparisons(list(policies)) == [("conditional", "always-remote")]
    rows = {line[:22].strip(): line for line in report.table(policies).splitlines()}
    assert rows["server queue p50 ms"].split()[-1] == "1.00x"
    assert "server KV xfer p50 ms" in rows  # zero everywhere, still shown


def test_commands_pass_extra_stack_args_through():
    opts = StackOptions(model="/m.gguf", stack_args=("--speculative", "ngram"),
                        disagg_args=("--no-pin",), num_prefill=2, transport="shm")
    colocated = command("colocated", opts, 5001, 5002)
    assert colocated[1:5] == ["-m", "pdserve", "gateway", "--colocated"]
    assert colocated[-4:] == ["--model", "/m.gguf", "--speculative", "ngram"]
    up = " ".join(command("disagg", opts, 5001, 5002))
    assert "up --host 127.0.0.1 --port 5001 --http-port 5002 --prefill 2" in up
    assert up.endswith("--transport shm --model /m.gguf --no-pin --speculative ngram")
    for backend, policy in (("conditional", "auto"), ("always-remote", "always-remote")):
        up = " ".join(command(backend, opts, 5001, 5002))
        assert f"--transport shm --model /m.gguf --prefill-policy {policy} --no-pin" in up
    naive = command("naive", opts, 5001, 5002)
    assert "pdserve.bench.naive_server" in naive and "--speculative" not in naive
    # transformers runs on the dtype our stacks resolve "auto" to, or the one asked for
    auto = dtype_name(resolve_dtype(None, torch.device("cpu")))
    assert naive[naive.index("--dtype") + 1] == auto
    naive = command("naive", StackOptions(dtype="float32"), 5001, 5002)
    assert naive[naive.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError, match="backend must be one of"):
        command("vllm", opts, 1, 2)


def test_cli_flags(tmp_path):
    args = build_parser().parse_args(shlex.split(
        f"bench --backends colocated --stack-args '--speculative ngram' --concurrency 1 4 "
        f"--workload mixed --long-input-len 1000 1500 --ttft-slo-ms 0 --out {tmp_path}"))
    cfg, wcfg, stacks = configs(args)
    assert stacks.stack_args == ("--speculative", "ngram")
    assert cfg.concurrency == (1, 4) and cfg.slo == SLO(None, 200.0)
    assert wcfg.name == "mixed" and wcfg.long_input_range == (1000, 1500)
    with pytest.raises(ValueError, match="concurrency"):
        configs(build_parser().parse_args(["bench", "--concurrency", "0"]))
    # the defaults: chat requests with the server's sampling; the policy backends for the
    # workloads that compare them; a curve runs greedy beside sampled at 1 8 32 64
    from pdserve.bench.command import _targets

    args = build_parser().parse_args(["bench"])
    cfg, _, _ = configs(args)
    assert (cfg.api, cfg.sampling.fields(), cfg.concurrency) == ("chat", {}, (1, 8, 32))
    assert _targets(args) == ["naive", "colocated", "disagg"]
    args = build_parser().parse_args(["bench", "--workload", "multi-turn"])
    assert _targets(args) == ["conditional", "always-remote", "colocated"]
    cfg, _, _ = configs(build_parser().parse_args(
        ["bench", "--curve", "c.png", "--temperature", "0.7", "--top-k", "50",
         "--repetition-penalty", "1.1"]))
    assert cfg.concurrency == (1, 8, 32, 64)
    assert [(suffix, s.fields()) for suffix, s in cfg.variants()] == [
        ("", {"temperature": 0.7, "top_k": 50, "repetition_penalty": 1.1}),
        ("-greedy", {"temperature": 0.0})]
    with pytest.raises(ValueError, match="temperature other than 0"):
        configs(build_parser().parse_args(["bench", "--vs-greedy", "--temperature", "0"]))


def test_kv_offload_dir_runs_each_backend_with_and_without_the_disk_tier(tmp_path):
    """--kv-offload-dir: <backend> as given, then <backend>+disk with the tier in a folder of
    its own, emptied first (a run never starts warm from an earlier one); the naive server
    has no tiers. --history-len reaches the multi-turn workload."""
    from pdserve.bench.command import _offload_variants

    args = build_parser().parse_args(shlex.split(
        f"bench --workload multi-turn --history-len 1000 3000 --kv-offload-dir {tmp_path} "
        f"--stack-args '--kv-cache-memory-gb 0.1'"))
    _, wcfg, stacks = configs(args)
    assert wcfg.history_len == (1000, 3000)
    stale = tmp_path / "colocated" / "old.kv"
    stale.parent.mkdir()
    stale.write_bytes(b"from an earlier run")
    plain, tiered = _offload_variants("colocated", stacks, args.kv_offload_dir)
    assert plain == ("colocated", stacks) and not stale.exists()
    assert tiered[0] == "colocated+disk"
    assert tiered[1].stack_args == ("--kv-cache-memory-gb", "0.1", "--kv-offload-dir",
                                    str(tmp_path / "colocated"))
    assert "--kv-offload-dir" in command("colocated", tiered[1], 1, 2)
    assert _offload_variants("naive", stacks, args.kv_offload_dir) == [("naive", stacks)]
    assert _offload_variants("disagg", stacks, None) == [("disagg", stacks)]


def test_offload_counts_from_the_workers_metrics(tmp_path):
    """A disaggregated server has no tier counts in /internal/status: they are summed from
    the workers' /metrics that `pdserve up` printed (the gateway's URL first, skipped)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily

    from pdserve.bench.command import _offload_counts
    from service_infra.metrics.http import serve_metrics

    class Tier:
        def __init__(self, hits):
            self.hits = hits

        def collect(self):
            for name, value in (("hits", self.hits), ("misses", 1), ("loaded_bytes", 2**20)):
                family = CounterMetricFamily(f"pdserve:kv_offload_{name}", "", labels=["tier"])
                family.add_metric(["disk"], value)
                yield family

    servers = []
    for hits in (3, 4):
        registry = CollectorRegistry()
        registry.register(Tier(hits))
        servers.append(serve_metrics(registry, "127.0.0.1", 0))
    try:
        urls = [f"http://127.0.0.1:{s.server_port}/metrics" for s in servers]
        log = tmp_path / "up.log"
        log.write_text("pdserve up: ready.\n  metrics: http://127.0.0.1:9/metrics "
                       + " ".join(urls) + "\n")
        counts = _offload_counts(Target("disagg", "http://127.0.0.1:9", None, log))
        assert counts == {"disk": {"hits": 7, "misses": 2, "corrupt": 0, "errors": 0,
                                   "bytes_loaded": 2 * 2**20}}
        assert _offload_counts(Target("x", "http://127.0.0.1:9", None, None)) is None
    finally:
        for server in servers:
            server.shutdown()


def test_wait_healthy_names_an_early_exit_with_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("Traceback: bad flag --speculative\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    target = Target("colocated", "http://127.0.0.1:9", "127.0.0.1:9", log)
    with pytest.raises(RuntimeError, match=r"exited with code 3(.|\n)*bad flag"):
        wait_healthy(proc, target, timeout_s=30)


def test_stop_kills_a_server_that_ignores_sigterm_and_its_children(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            f"start_new_session=True); open({str(pid_file)!r}, 'w').write(str(c.pid));"
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert stop(proc, timeout_s=0.5) is None  # killed
    deadline = time.monotonic() + 5
    while not is_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert is_gone(child)


def is_gone(pid: int) -> bool:
    """Exited (or a zombie, until whoever adopted it reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
