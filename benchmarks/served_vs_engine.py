"""Served tokens/s over the engine's own, at one concurrency: the host-cost figure of the GPU
check (benchmarks/gpu_check.sh), from the results its two steps wrote.

    python benchmarks/served_vs_engine.py BENCH_ENGINE_RESULTS_JSON SERVE_OUT_DIR [--concurrency 64]

BENCH_ENGINE_RESULTS_JSON: `pdserve bench-engine`'s results.json; SERVE_OUT_DIR: the --out of
`pdserve bench` (its <backend>-c<N>.json points). Each served backend's output tokens/s is
divided by the engine's with the same sampling at the same concurrency (the served run's
--temperature, --top-p and --top-k against bench-engine's --sampling settings). Prints one
line per backend; exits 1 when a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine_results", type=Path)
    p.add_argument("serve_dir", type=Path)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()
    results = json.loads(args.engine_results.read_text())
    points = sorted(args.serve_dir.glob(f"*-c{args.concurrency}.json"))
    if not points:
        print(f"no served point at c={args.concurrency} in {args.serve_dir}")
        return 1
    missing = False
    for path in points:
        point = json.loads(path.read_text())
        want = {k: float(v) for k, v in point.get("sampling", {}).items()}
        engine = next((r for r in results["engine"] if r["concurrency"] == args.concurrency
                       and _setting(r["sampling"]) == want), None)
        label = "greedy" if want == {"temperature": 0.0} else (
            ",".join(f"{k}={v:g}" for k, v in want.items()) or "the server's default sampling")
        if engine is None:
            print(f"{point['backend']}: no engine figure at c={args.concurrency} with {label} "
                  f"(bench-engine ran {sorted({r['sampling'] for r in results['engine']})})")
            missing = True
            continue
        served, own = point["output_throughput"], engine["output_tokens_per_s"]
        print(f"{point['backend']:<10} c={args.concurrency} {label}: served {served:.1f} "
              f"tok/s, engine {own:.1f} tok/s, served / engine {served / own:.2f}")
    return 1 if missing else 0


def _setting(sampling: str) -> dict[str, float]:
    """bench-engine's sampling ("greedy", "temperature=1.0,top_p=0.95,top_k=50") as the
    served point's request fields."""
    if sampling == "greedy":
        return {"temperature": 0.0}
    return {k: float(v) for k, v in (kv.split("=") for kv in sampling.split(","))}


if __name__ == "__main__":
    sys.exit(main())
