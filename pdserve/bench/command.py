"""`pdserve bench`: load-test the gateway against its baselines, same model, same machine, same
run, and report them side by side.

    pdserve bench                                        # naive | colocated | disagg, c = 1 8 32
    pdserve bench --backends colocated disagg --workload mixed --concurrency 8
    pdserve bench --backends colocated --stack-args "--max-num-seqs 16" --protocol grpc
    pdserve bench --gateway 127.0.0.1:50051 --concurrency 1 4     # a gateway already running

The backends run one after the other (each started, benched at every concurrency, stopped), so
they never share the two cores. The naive server generates one request at a time at about 10
tokens/s here, so it gets at most --naive-max-requests requests and --naive-max-duration
seconds per point: its figures are measured over those requests, not extrapolated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import shlex
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx

from pdserve.bench import report
from pdserve.bench.client import Client, GrpcClient, HttpClient, Sampling
from pdserve.bench.metrics import SLO
from pdserve.bench.runner import Lane, run_lanes
from pdserve.bench.servers import StackOptions, Target, launch
from pdserve.bench.workloads import BenchRequest, WorkloadConfig, build_workload

WARMUP_TOKENS = 4


@dataclass(frozen=True)
class BenchConfig:
    protocol: str = "http"  # how the gateways are reached; the naive server: always HTTP
    concurrency: tuple[int, ...] = (1, 8, 32)
    request_rate: float = math.inf
    long_rate: float = 0.5  # mixed: long prompts per second
    max_duration_s: float = 300.0
    naive_max_requests: int = 8
    naive_max_duration_s: float = 120.0
    temperature: float = 0.0
    slo: SLO = SLO(2000.0, 200.0)
    seed: int = 0
    top_p: float | None = None  # None: the request leaves it out (the server's default, 1)
    top_k: int | None = None

    def __post_init__(self) -> None:
        if self.protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {self.protocol!r}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency must be >= 1, got {list(self.concurrency)}")
        for name in ("request_rate", "long_rate", "max_duration_s", "naive_max_duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.naive_max_requests < 1:
            raise ValueError(f"naive_max_requests must be >= 1, got {self.naive_max_requests}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k)


def configs(args: argparse.Namespace) -> tuple[BenchConfig, WorkloadConfig, StackOptions]:
    slo = SLO(args.ttft_slo_ms if args.ttft_slo_ms > 0 else None,
              args.tpot_slo_ms if args.tpot_slo_ms > 0 else None)
    bench = BenchConfig(args.protocol, tuple(args.concurrency), args.request_rate,
                        args.long_rate, args.max_duration, args.naive_max_requests,
                        args.naive_max_duration, args.temperature, slo, args.seed,
                        args.top_p, args.top_k)
    workload = WorkloadConfig(
        args.workload, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
        args.prefix_len, args.num_long, tuple(args.long_input_len), args.long_output_len,
        args.ignore_eos, args.seed)
    stacks = StackOptions(args.model, args.dtype, tuple(shlex.split(args.stack_args)),
                          tuple(shlex.split(args.colocated_args)),
                          tuple(shlex.split(args.disagg_args)),
                          tuple(shlex.split(args.naive_args)), args.prefill, args.decode,
                          args.transport)
    return bench, workload, stacks


def lanes(workload: dict[str, list[BenchRequest]], concurrency: int, cfg: BenchConfig,
          is_naive: bool) -> list[Lane]:
    """The lanes of one point. The naive server gets the first requests only."""
    cap = cfg.naive_max_requests if is_naive else None
    if "long" in workload:  # mixed: decode streams at `concurrency` while long prompts arrive
        long = Lane(workload["long"][:max(1, cap // 4) if cap else None],
                    request_rate=cfg.long_rate)
        decode = Lane(workload["decode"][:cap], concurrency, until=long)
        return [decode, long]
    return [Lane(workload["main"][:cap], concurrency, cfg.request_rate)]


def make_client(target: Target, protocol: str, sampling: Sampling) -> Client:
    if protocol == "grpc" and target.grpc_address:
        return GrpcClient(target.grpc_address, sampling)
    if target.http_url is None:
        raise ValueError(f"{target.name} has no HTTP address; use --protocol grpc")
    return HttpClient(target.http_url, sampling)


async def bench_target(target: Target, workload: dict[str, list[BenchRequest]],
                       cfg: BenchConfig, workload_name: str,
                       out_dir: Path) -> dict[int, dict[str, Any]]:
    """Every concurrency point of one system; one JSON file per point."""
    client = make_client(target, cfg.protocol, cfg.sampling)
    is_naive = target.name == "naive"
    notes = [f"sampling: {cfg.sampling.fields()}"]
    if is_naive:
        notes.append(f"naive: at most {cfg.naive_max_requests} requests and "
                     f"{cfg.naive_max_duration_s:g} s per point, one request at a time; "
                     f"measured over those requests, not extrapolated")
    if client.protocol != cfg.protocol:
        notes.append(f"{target.name}: reached over {client.protocol} (it has no "
                     f"{cfg.protocol} API)")
    points = {}
    try:
        model_id = await client.model_id()
        first = next(iter(workload.values()))[0]
        warm = await client.send(dataclasses.replace(first, output_len=WARMUP_TOKENS))
        if not warm.is_success:
            raise RuntimeError(f"{target.name}: the warm-up request failed: {warm.error}")
        for c in cfg.concurrency:
            results, duration = await run_lanes(
                client.send, lanes(workload, c, cfg, is_naive),
                cfg.naive_max_duration_s if is_naive else cfg.max_duration_s, cfg.seed,
                desc=f"{target.name} c={c}")
            point = report.point_result(
                backend=target.name, protocol=client.protocol, model_id=model_id,
                workload=workload_name, max_concurrency=c, request_rate=cfg.request_rate,
                results=results, duration_s=duration, slo=cfg.slo, notes=notes)
            report.write_json(out_dir / f"{target.name}-c{c}.json", point)
            print(report.headline(point), flush=True)
            points[c] = point
    finally:
        await client.close()
    return points


def _structured_points(target: Target, workload: dict[str, list[BenchRequest]],
                       cfg: BenchConfig, out_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """The structured workload: the unconstrained lane, then the json-schema lane, as two
    systems "<target>-<lane>" of one run; the json-schema points note the engine's mask time
    per step (a colocated server's /internal/status), where the server reports it."""
    points = {}
    for lane in ("unconstrained", "json-schema"):
        named = dataclasses.replace(target, name=f"{target.name}-{lane}")
        before = _mask_stats(target)
        points[named.name] = asyncio.run(bench_target(named, {"main": workload[lane]}, cfg,
                                                      "structured", out_dir))
        after = _mask_stats(target)
        if before is not None and after is not None and after[0] > before[0]:
            steps, seconds = after[0] - before[0], after[1] - before[1]
            note = (f"grammar mask: {1e3 * seconds / steps:.2f} ms per step over {steps} "
                    f"steps ({lane})")
            print(note, flush=True)
            for point in points[named.name].values():
                point["notes"].append(note)
    return points


def _mask_stats(target: Target) -> tuple[int, float] | None:
    """(mask steps, mask seconds) of a colocated server; None where it does not say."""
    if target.http_url is None:
        return None
    try:
        status = httpx.get(f"{target.http_url}/internal/status", timeout=30).json()
        mask = status["grammar_mask"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return int(mask["num_steps"]), float(mask["seconds"])


def _targets(args: argparse.Namespace) -> list[str | Target]:
    """Backend names to start, or the one running server to bench."""
    if not (args.gateway or args.base_url):
        return list(dict.fromkeys(args.backends))
    if args.gateway and not args.base_url:
        args.protocol = "grpc"
    elif args.base_url and not args.gateway:
        args.protocol = "http"
    return [Target(args.label or "gateway", args.base_url, args.gateway)]


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the harness like Ctrl-C: the servers it started are stopped on the way
    out."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run(args: argparse.Namespace) -> int:
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer

    cfg, wcfg, stacks = configs(args)
    targets = _targets(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = build_workload(wcfg, load_tokenizer(resolve_model(args.model)))
    points: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        with _sigterm_as_interrupt():
            for t in targets:
                if isinstance(t, Target):
                    if wcfg.name == "structured":
                        points.update(_structured_points(t, workload, cfg, out_dir))
                        continue
                    points[t.name] = asyncio.run(bench_target(t, workload, cfg, wcfg.name,
                                                              out_dir))
                    continue
                print(f"pdserve bench: starting {t} (log: {out_dir / 'logs' / (t + '.log')})",
                      flush=True)
                with launch(t, stacks, out_dir / "logs") as target:
                    if wcfg.name == "structured":
                        points.update(_structured_points(target, workload, cfg, out_dir))
                        continue
                    points[t] = asyncio.run(bench_target(target, workload, cfg, wcfg.name,
                                                         out_dir))
    except KeyboardInterrupt:
        print(f"\npdserve bench: interrupted; the servers it started are stopped; the points "
              f"finished so far are in {out_dir}", flush=True)
        return 130
    notes = sorted({n for by_c in points.values() for p in by_c.values() for n in p["notes"]})
    config = {k: v if not isinstance(v, float) or math.isfinite(v) else str(v)
              for k, v in vars(args).items() if k != "func"}
    summary = report.summary(points, notes, config)
    report.write_json(out_dir / "summary.json", summary)
    print(report.table(points))
    for note in notes:
        print(f"note: {note}")
    from pdserve.bench.plots import plot_latency, plot_throughput

    fields = cfg.sampling.fields()
    sampling = ("greedy" if fields == {"temperature": 0.0}
                else ", ".join(f"{k} {v:g}" for k, v in fields.items()))
    title = f"{wcfg.name} workload, {cfg.protocol}, {sampling}"
    plot_latency(points, out_dir / "latency.png", f"Latency percentiles, {title}")
    plot_throughput(points, out_dir / "throughput.png", f"Throughput, {title}")
    print(f"\nwrote {out_dir}/: summary.json, <backend>-c<concurrency>.json per point, "
          f"latency.png, throughput.png, logs/")
    return 0
