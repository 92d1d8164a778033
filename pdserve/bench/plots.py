"""PNG plots of a sweep (matplotlib, Agg backend): latency percentiles and throughput against
concurrency, one line per backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

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
