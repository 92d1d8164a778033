"""Result files and the side-by-side table.

One JSON per (backend, concurrency) in the shape of `vllm bench serve`'s result file (its keys,
plus `incomplete`, the SLOs and, for the mixed workload, the same figures per lane under
`groups`), and a summary with every point's figures and each comparison's ratios: to the
naive server, sampled to greedy (`<backend>-greedy`, the same server's greedy run) and
conditional prefill to always-remote.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import SLO, RequestResult, compute_metrics, per_request

# (label, key, has_ratio) rows of the table: keys of a point's result; counts get no ratio
ROWS: list[tuple[str, str, bool]] = [
    ("completed", "completed", False),
    ("failed", "failed", False),
    ("incomplete", "incomplete", False),
    ("requests/s", "request_throughput", True),
    ("goodput req/s", "request_goodput", True),
    ("output tok/s", "output_throughput", True),
] + [(f"{name} p{q} ms", f"p{q}_{key}_ms", True)
     for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el"))
     for q in (50, 90, 99)] + [
    # where the time went, as the server reports it (metrics.server_timing)
    ("server queue p50 ms", "median_queue_ms", True),
    ("server prefill p50 ms", "median_prefill_ms", True),
    ("server KV xfer p50 ms", "median_kv_transfer_ms", True),
    ("local prefills", "prefill_local_share", False),
]
# the mixed workload's lanes: what the issue compares between colocated and disaggregated
GROUP_ROWS: dict[str, list[tuple[str, str, bool]]] = {
    "decode": [("decode ITL p50 ms", "p50_itl_ms", True),
               ("decode ITL p90 ms", "p90_itl_ms", True),
               ("decode ITL p99 ms", "p99_itl_ms", True),
               ("decode TPOT p99 ms", "p99_tpot_ms", True),
               ("decode goodput req/s", "request_goodput", True)],
    "long": [("long TTFT p50 ms", "p50_ttft_ms", True),
             ("long TTFT p99 ms", "p99_ttft_ms", True),
             ("long goodput req/s", "request_goodput", True)],
    # multi-turn: the follow-ups are what conditional prefill is for
    "first-turn": [("turn-1 TTFT p50 ms", "p50_ttft_ms", True)],
    "follow-up": [("follow-up TTFT p50 ms", "p50_ttft_ms", True),
                  ("follow-up TTFT p99 ms", "p99_ttft_ms", True),
                  ("follow-up ITL p99 ms", "p99_itl_ms", True),
                  ("follow-up local", "prefill_local_share", False)],
}
GREEDY_SUFFIX = "-greedy"  # the label of a backend's greedy run beside its sampled one


def comparisons(labels: Sequence[str]) -> list[tuple[str, str]]:
    """The (label, base) pairs the table and summary give ratios for: each backend against
    naive, each sampled run against its greedy run, conditional against always-remote."""
    pairs = [(b, "naive") for b in labels if b != "naive" and "naive" in labels]
    pairs += [(b + GREEDY_SUFFIX, "naive") for b, base in list(pairs)
              if b + GREEDY_SUFFIX in labels]
    pairs += [(b, b + GREEDY_SUFFIX) for b in labels if b + GREEDY_SUFFIX in labels]
    if "conditional" in labels and "always-remote" in labels:
        pairs.append(("conditional", "always-remote"))
    return pairs


def point_result(*, backend: str, protocol: str, model_id: str, workload: str,
                 max_concurrency: int, request_rate: float, results: Sequence[RequestResult],
                 duration_s: float, slo: SLO, notes: Sequence[str] = ()) -> dict[str, Any]:
    """One (backend, concurrency) point, as `vllm bench serve` writes it."""
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend,
        "endpoint_type": protocol, "label": backend, "model_id": model_id,
        "tokenizer_id": model_id, "workload": workload, "num_prompts": len(results),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": 1.0, "max_concurrency": max_concurrency, "duration": duration_s,
        "goodput_slos": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
    }
    out.update(compute_metrics(results, duration_s, slo))
    groups = sorted({r.group for r in results})
    if groups != ["main"]:
        out["groups"] = {g: compute_metrics([r for r in results if r.group == g], duration_s,
                                            slo) for g in groups}
    out.update(per_request(results))
    out["notes"] = list(notes)
    return out


def headline(point: dict[str, Any]) -> str:
    """One line per point, printed as the sweep goes."""
    return (f"{point['backend']:>10} c={point['max_concurrency']:<3} "
            f"{point['completed']}/{point['num_prompts']} ok, {point['failed']} failed, "
            f"{point['output_throughput']:.1f} tok/s, TTFT p50 {point['p50_ttft_ms']:.0f} ms, "
            f"TPOT p50 {point['p50_tpot_ms']:.0f} ms, ITL p99 {point['p99_itl_ms']:.0f} ms")


def value(point: dict[str, Any], group: str | None, key: str) -> float | None:
    src = point if group is None else point.get("groups", {}).get(group)
    return None if src is None else src.get(key)


def summary(points: dict[str, dict[int, dict[str, Any]]], notes: Sequence[str],
            config: dict[str, Any]) -> dict[str, Any]:
    """Every point's figures (without the per-request lists) and the ratios of each
    comparison ("<label>/<base>": {concurrency: {row: ratio}})."""
    lists = set(per_request([]))
    out: dict[str, Any] = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "config": config,
                           "notes": list(notes), "backends": {}, "ratios": {}}
    for backend, by_c in points.items():
        out["backends"][backend] = {str(c): {k: v for k, v in p.items() if k not in lists}
                                    for c, p in by_c.items()}
    for label, base in comparisons(list(points)):
        ratios = {}
        for c, p in points[label].items():
            if c in points[base]:
                ratios[str(c)] = {row: _ratio(value(p, g, k), value(points[base][c], g, k))
                                  for row, g, k, has_ratio in _rows(p) if has_ratio}
        if ratios:
            out["ratios"][f"{label}/{base}"] = ratios
    return out


def _rows(point: dict[str, Any]) -> list[tuple[str, str | None, str, bool]]:
    rows = [(label, None, key, hi) for label, key, hi in ROWS]
    for group, group_rows in GROUP_ROWS.items():
        if group in point.get("groups", {}):
            rows += [(label, group, key, hi) for label, key, hi in group_rows]
    return rows


def _ratio(x: float | None, base: float | None) -> float | None:
    if x is None or not base:
        return None
    return x / base


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, int) or float(x).is_integer() and abs(x) < 1e6:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def table(points: dict[str, dict[int, dict[str, Any]]]) -> str:
    """The metrics side by side per concurrency (naive | colocated | disagg ...), then the
    ratio of each comparison (times the base's figure: for throughput higher is better, for
    latency lower is better)."""
    backends = list(points)
    lines = []
    for c in sorted({c for by_c in points.values() for c in by_c}):
        have = [b for b in backends if c in points[b]]
        pairs = [(b, base) for b, base in comparisons(have)]
        width = max([12] + [len(b) + 2 for b in have])
        ratio_width = max([17] + [len(f"{b}/{base}") + 2 for b, base in pairs])
        first = points[have[0]][c]
        head = f"{'concurrency ' + str(c):<22}" + "".join(f"{b:>{width}}" for b in have) + \
            "".join(f"{b + '/' + base:>{ratio_width}}" for b, base in pairs)
        lines += ["", head, "-" * len(head)]
        for label, group, key, has_ratio in _rows(first):
            vals = [value(points[b][c], group, key) for b in have]
            if all(v is None for v in vals):
                continue  # e.g. the server's timing, from a server that sends none
            line = f"{label:<22}" + "".join(f"{_fmt(v):>{width}}" for v in vals)
            if has_ratio:
                for b, base in pairs:
                    r = _ratio(value(points[b][c], group, key),
                               value(points[base][c], group, key))
                    line += f"{'-' if r is None else f'{r:.2f}x':>{ratio_width}}"
            lines.append(line)
    return "\n".join(lines)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str))
