"""PNG plots of a sweep (matplotlib, Agg backend): latency percentiles and throughput against
concurrency, one line per backend; the curve of output tokens/s, greedy beside sampled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from pdserve.bench.report import GREEDY_SUFFIX  # noqa: E402

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "end-to-end"))
PERCENTILE_STYLES = ((50, "-", "o"), (90, "--", "s"), (99, ":", "^"))
THROUGHPUTS = (("output_throughput", "output tokens / s"), ("request_throughput",
               "requests / s"), ("request_goodput", "goodput (requests / s within SLO)"))


def _series(points: dict[int, dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    cs = sorted(points)
    return cs, [points[c][key] for c in cs]


def _axes_style(ax, cs: set[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(cs), [str(c) for c in sorted(cs)])
    ax.set_xlabel("concurrency (requests in flight at most)")
    ax.grid(True, alpha=0.3)


def plot_latency(points: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> None:
    """2 x 2 panels (TTFT, TPOT, ITL, E2E); p50 / p90 / p99 per backend."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    cs = {c for by_c in points.values() for c in by_c}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, name) in zip(axes.flat, LATENCIES, strict=True):
        for i, (backend, by_c) in enumerate(points.items()):
            for q, style, marker in PERCENTILE_STYLES:
                x, y = _series(by_c, f"p{q}_{key}_ms")
                ax.plot(x, y, style, marker=marker, color=colors[i % len(colors)],
                        label=f"{backend} p{q}")
        ax.set_yscale("log", nonpositive="mask")  # an empty metric is 0
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        _axes_style(ax, cs)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(points: dict[str, dict[int, dict[str, Any]]], path: Path,
                    title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    cs = {c for by_c in points.values() for c in by_c}
    for ax, (key, name) in zip(axes, THROUGHPUTS, strict=True):
        for backend, by_c in points.items():
            x, y = _series(by_c, key)
            ax.plot(x, y, "-o", label=backend)
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.set_title(name)
        _axes_style(ax, cs)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curve(points: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> None:
    """Output tokens/s against concurrency: one color per backend, its sampled run solid and
    its greedy run (`<backend>-greedy`) dashed, each sampled point labelled with its ratio to
    greedy."""
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    sampled = [b for b in points if not b.endswith(GREEDY_SUFFIX)]
    for i, backend in enumerate(sampled):
        color = colors[i % len(colors)]
        x, y = _series(points[backend], "output_throughput")
        ax.plot(x, y, "-o", color=color, label=f"{backend}, sampled")
        greedy = points.get(backend + GREEDY_SUFFIX)
        if greedy:
            gx, gy = _series(greedy, "output_throughput")
            ax.plot(gx, gy, "--s", color=color, alpha=0.7, label=f"{backend}, greedy")
            for c, v in zip(x, y, strict=True):
                if greedy.get(c, {}).get("output_throughput"):
                    ax.annotate(f"{v / greedy[c]['output_throughput']:.2f}x", (c, v),
                                textcoords="offset points", xytext=(4, -12), fontsize=8,
                                color=color)
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    _axes_style(ax, {c for by_c in points.values() for c in by_c})
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
