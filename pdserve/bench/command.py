"""`pdserve bench`: load-test the gateway against its baselines, same model, same machine, same
run, and report them side by side.

    pdserve bench                                        # naive | colocated | disagg, c = 1 8 32
    pdserve bench --workload multi-turn --concurrency 4  # conditional | always-remote | colocated
    pdserve bench --backends colocated disagg --temperature 1.0 --top-p 0.95 --curve curve.png
    pdserve bench --backends colocated disagg --workload mixed --concurrency 8
    pdserve bench --backends colocated --stack-args "--max-num-seqs 16" --protocol grpc
    pdserve bench --gateway 127.0.0.1:50051 --concurrency 1 4     # a gateway already running

The backends run one after the other (each started, benched at every concurrency, stopped), so
they never share the two cores. The naive server generates one request at a time at about 10
tokens/s here, so it gets at most --naive-max-requests requests and --naive-max-duration
seconds per point: its figures are measured over those requests, not extrapolated.

Requests go out as clients send them: chat completions, with the sampling fields given (none by
default: the server's temperature 1.0). `--vs-greedy` (and `--curve`) runs every point twice on
the same server, greedy (`<backend>-greedy`) and sampled, alternating which goes first, and
reports their ratio; each variant has prompts of its own (the workload's seed + 1 for the
second), so that neither finds the other's in the prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import shlex
import shutil
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx

from pdserve.bench import report
from pdserve.bench.args import DEFAULT_BACKENDS, POLICY_BACKENDS
from pdserve.bench.client import GREEDY, Client, GrpcClient, HttpClient, Sampling
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
    temperature: float | None = None  # None: the request leaves it out (the server's 1.0)
    slo: SLO = SLO(2000.0, 200.0)
    seed: int = 0
    top_p: float | None = None  # None: the request leaves it out (the server's default, 1)
    top_k: int | None = None
    repetition_penalty: float | None = None
    api: str = "chat"  # plain prompts as chat requests ("chat") or as completions
    is_vs_greedy: bool = False  # every point also greedy, on the same server

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
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be chat or completions, got {self.api!r}")
        if self.is_vs_greedy and self.sampling.is_greedy:
            raise ValueError("--vs-greedy and --curve compare a sampled run with greedy: "
                             "give a temperature other than 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.repetition_penalty)

    def variants(self) -> list[tuple[str, Sampling]]:
        """(label suffix, sampling) of the runs of every point."""
        if self.is_vs_greedy:
            return [("", self.sampling), (report.GREEDY_SUFFIX, GREEDY)]
        return [("", self.sampling)]


def configs(args: argparse.Namespace) -> tuple[BenchConfig, WorkloadConfig, StackOptions]:
    slo = SLO(args.ttft_slo_ms if args.ttft_slo_ms > 0 else None,
              args.tpot_slo_ms if args.tpot_slo_ms > 0 else None)
    concurrency = args.concurrency or ([1, 8, 32, 64] if args.curve else [1, 8, 32])
    bench = BenchConfig(args.protocol, tuple(concurrency), args.request_rate,
                        args.long_rate, args.max_duration, args.naive_max_requests,
                        args.naive_max_duration, args.temperature, slo, args.seed,
                        args.top_p, args.top_k, args.repetition_penalty, args.api,
                        args.vs_greedy or bool(args.curve))
    workload = WorkloadConfig(
        args.workload, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
        args.prefix_len, args.num_long, tuple(args.long_input_len), args.long_output_len,
        args.ignore_eos, args.seed,
        tuple(args.history_len) if getattr(args, "history_len", None) else None)
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


def make_client(target: Target, protocol: str, sampling: Sampling, api: str = "chat") -> Client:
    if protocol == "grpc" and target.grpc_address:
        return GrpcClient(target.grpc_address, sampling, api)
    if target.http_url is None:
        raise ValueError(f"{target.name} has no HTTP address; use --protocol grpc")
    return HttpClient(target.http_url, sampling, api)


async def bench_target(target: Target, workloads: Sequence[dict[str, list[BenchRequest]]],
                       cfg: BenchConfig, workload_name: str,
                       out_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """Every concurrency point of one system, once per sampling variant (label: the backend,
    then `<backend>-greedy`), each variant with its own prompts (`workloads`, one per
    variant: the second must not find the first's prompts in the prefix cache); one JSON
    file per point."""
    clients = {target.name + suffix: make_client(target, cfg.protocol, sampling, cfg.api)
               for suffix, sampling in cfg.variants()}
    workload_of = dict(zip(clients, workloads, strict=True))
    client = clients[target.name]
    is_naive = target.name == "naive"
    notes = [f"sampling: {cfg.sampling.describe()}", f"api: {cfg.api}"]
    if is_naive:
        notes.append(f"naive: at most {cfg.naive_max_requests} requests and "
                     f"{cfg.naive_max_duration_s:g} s per point, one request at a time; "
                     f"measured over those requests, not extrapolated")
    if client.protocol != cfg.protocol:
        notes.append(f"{target.name}: reached over {client.protocol} (it has no "
                     f"{cfg.protocol} API)")
    points: dict[str, dict[int, dict[str, Any]]] = {label: {} for label in clients}
    try:
        model_id = await client.model_id()
        first = next(iter(workloads[0].values()))[0]
        warm = await client.send(dataclasses.replace(first, output_len=WARMUP_TOKENS,
                                                     follow_ups=()))
        if not warm.is_success:
            raise RuntimeError(f"{target.name}: the warm-up request failed: {warm.error}")
        for i, c in enumerate(cfg.concurrency):
            # alternate which variant goes first: a shared machine's speed drifts
            for label in list(clients)[::1 if i % 2 == 0 else -1]:
                results, duration = await run_lanes(
                    clients[label].send, lanes(workload_of[label], c, cfg, is_naive),
                    cfg.naive_max_duration_s if is_naive else cfg.max_duration_s, cfg.seed,
                    desc=f"{label} c={c}")
                point = report.point_result(
                    backend=label, protocol=client.protocol, model_id=model_id,
                    workload=workload_name, max_concurrency=c, request_rate=cfg.request_rate,
                    results=results, duration_s=duration, slo=cfg.slo, notes=notes)
                point["sampling"] = clients[label].sampling.fields()
                report.write_json(out_dir / f"{label}-c{c}.json", point)
                print(report.headline(point), flush=True)
                points[label][c] = point
    finally:
        for each in clients.values():
            await each.close()
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
        got = asyncio.run(bench_target(named, [{"main": workload[lane]}] * len(cfg.variants()),
                                       cfg, "structured", out_dir))
        points.update(got)
        after = _mask_stats(target)
        if before is not None and after is not None and after[0] > before[0]:
            steps, seconds = after[0] - before[0], after[1] - before[1]
            note = (f"grammar mask: {1e3 * seconds / steps:.2f} ms per step over {steps} "
                    f"steps ({lane})")
            print(note, flush=True)
            for by_c in got.values():
                for point in by_c.values():
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


def _offload_variants(backend: str, stacks: StackOptions,
                      offload_dir: str | None) -> list[tuple[str, StackOptions]]:
    """The stacks to start for one backend: as given, and with --kv-offload-dir, once more
    with the disk tier in a fresh folder of its own (`<backend>+disk`)."""
    if offload_dir is None or backend == "naive":
        return [(backend, stacks)]
    folder = Path(offload_dir) / backend
    shutil.rmtree(folder, ignore_errors=True)
    with_tier = dataclasses.replace(
        stacks, stack_args=(*stacks.stack_args, "--kv-offload-dir", str(folder.resolve())))
    return [(backend, stacks), (f"{backend}+disk", with_tier)]


def _offload_counts(target: Target) -> dict[str, dict[str, float]] | None:
    """Each tier's counters summed over the server's engines: a colocated server's
    /internal/status, else the workers' /metrics that `pdserve up` printed in its log."""
    try:
        return httpx.get(f"{target.http_url}/internal/status", timeout=30).json()["kv_offload"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    from prometheus_client.parser import text_string_to_metric_families

    text = target.log.read_text(errors="replace") if target.log else ""
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("metrics: ")]
    if not lines:
        return None
    names = {"kv_offload_hits": "hits", "kv_offload_misses": "misses",
             "kv_offload_corrupt": "corrupt", "kv_offload_errors": "errors",
             "kv_offload_loaded_bytes": "bytes_loaded"}
    out: dict[str, dict[str, float]] = {}
    for url in lines[-1].split()[2:]:  # the gateway's first: it has no tiers
        try:
            families = text_string_to_metric_families(httpx.get(url, timeout=30).text)
            for f in families:
                key = names.get(f.name.removeprefix("pdserve:"))
                for sample in f.samples if key else ():
                    if sample.name.endswith("_total"):
                        tier = out.setdefault(sample.labels["tier"], dict.fromkeys(
                            names.values(), 0.0))
                        tier[key] += sample.value
        except (httpx.HTTPError, ValueError):
            continue
    return out or None


def _note_offload(target: Target, points: dict[str, dict[int, dict[str, Any]]]) -> None:
    """The offload tiers' hits, misses and bytes loaded over the whole run (every engine of
    the server), as a note on its points."""
    tiers = _offload_counts(target)
    for tier, s in (tiers or {}).items():
        looked = s["hits"] + s["misses"]
        note = (f"{target.name}: {tier} tier {s['hits']:.0f} blocks hit of {looked:.0f} looked up "
                f"({s['hits'] / max(looked, 1):.0%}), {s['bytes_loaded'] / 2**20:.1f} MiB "
                f"loaded, {s['corrupt']} corrupt, {s['errors']} errors")
        print(note, flush=True)
        for by_c in points.values():
            for point in by_c.values():
                point["notes"].append(note)


def _targets(args: argparse.Namespace) -> list[str | Target]:
    """Backend names to start, or the one running server to bench."""
    if not (args.gateway or args.base_url):
        default = POLICY_BACKENDS if args.workload in ("mixed", "multi-turn") \
            else DEFAULT_BACKENDS
        return list(dict.fromkeys(args.backends or default))
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

    if args.workload == "host-overhead":
        return _host_overhead(args)

    targets = _targets(args)  # first: a lone --gateway or --base-url sets the protocol
    cfg, wcfg, stacks = configs(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(resolve_model(args.model))
    workloads = [build_workload(dataclasses.replace(wcfg, seed=wcfg.seed + k), tokenizer)
                 for k in range(len(cfg.variants()))]
    points: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        with _sigterm_as_interrupt():
            for t in targets:
                if isinstance(t, Target):
                    if wcfg.name == "structured":
                        points.update(_structured_points(t, workloads[0], cfg, out_dir))
                        continue
                    points.update(asyncio.run(bench_target(t, workloads, cfg, wcfg.name,
                                                           out_dir)))
                    continue
                for name, opts in _offload_variants(t, stacks, args.kv_offload_dir):
                    logs = out_dir / "logs" / ("" if name == t else "with-disk-tier")
                    print(f"pdserve bench: starting {name} (log: {logs / (t + '.log')})",
                          flush=True)
                    with launch(t, opts, logs) as target:
                        target = dataclasses.replace(target, name=name)
                        if wcfg.name == "structured":
                            points.update(_structured_points(target, workloads[0], cfg,
                                                             out_dir))
                            continue
                        got = asyncio.run(bench_target(target, workloads, cfg, wcfg.name,
                                                       out_dir))
                        if name != t:
                            _note_offload(target, got)
                        points.update(got)
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
    from pdserve.bench.plots import plot_curve, plot_latency, plot_throughput

    title = f"{wcfg.name} workload, {cfg.api} over {cfg.protocol}, {cfg.sampling.describe()}"
    plot_latency(points, out_dir / "latency.png", f"Latency percentiles, {title}")
    plot_throughput(points, out_dir / "throughput.png", f"Throughput, {title}")
    print(f"\nwrote {out_dir}/: summary.json, <backend>-c<concurrency>.json per point, "
          f"latency.png, throughput.png, logs/")
    if args.curve:
        plot_curve(points, Path(args.curve),
                   f"Output tokens/s, {wcfg.name} workload, {cfg.api} over {cfg.protocol}: "
                   f"greedy and {cfg.sampling.describe()}")
        print(f"wrote {args.curve}")
    return 0


def _host_overhead(args: argparse.Namespace) -> int:
    """The host-overhead workload (pdserve/bench/host_overhead.py): concurrency 256 unless
    one --concurrency is given; --num-prompts default 2 x concurrency, --input-len 32 and
    --output-len 128 unless given."""
    from pdserve.bench import host_overhead as ho
    from pdserve.bench.tiny_model import bench_tiny_model

    if args.concurrency and len(args.concurrency) > 1:
        raise ValueError("--workload host-overhead takes one --concurrency")
    c = args.concurrency[0] if args.concurrency else 256
    cfg = ho.HostConfig(
        model=args.model or str(bench_tiny_model()), concurrency=c,
        num_prompts=args.num_prompts if args.num_prompts != 32 else 2 * c,
        input_len=args.input_len if args.input_len != 128 else 32,
        output_len=args.output_len or 128, repeats=args.repeats,
        protocols=("http", "grpc"), stack_args=tuple(shlex.split(args.stack_args)),
        baseline_repo=Path(args.baseline_repo) if args.baseline_repo else None,
        dtype=args.dtype)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _sigterm_as_interrupt():
            results = ho.run_host_overhead(cfg, out_dir)
    except KeyboardInterrupt:
        print("\npdserve bench: interrupted; the servers it started are stopped", flush=True)
        return 130
    report.write_json(out_dir / "host_overhead.json", {"config": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
        "results": results})
    print(ho.table(results))
    print(f"wrote {out_dir}/host_overhead.json")
    return 0
