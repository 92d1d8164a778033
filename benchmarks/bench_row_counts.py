"""What a new row count costs a bf16 projection on the CPU: oneDNN compiles a kernel for every
call shape it has not met and keeps the last 1,024 (its primitive cache), so an engine whose
steps bring many row counts compiles kernels for as long as it runs.

    python benchmarks/bench_row_counts.py [--max-rows 600] [--steps 600] [--passes 3]
    python benchmarks/bench_row_counts.py --by-shape [--threads 2]

A "step" calls five projections of the tiny bench model's shapes (pdserve/bench/tiny_model.py:
qkv 128 -> 256, o 128 -> 128, gate_up 128 -> 512, down 256 -> 128, the head 128 -> 512) on the
same number of rows, uniform in 1..max-rows; the same steps run `passes` times, through
torch's own calls and through RowBucketedLinear (engine_core/platforms/cpu/prefill_matmuls.py:
the rows rounded up to a bucket). Prints this thread's CPU milliseconds per step for each pass:
a later pass meets only row counts an earlier one met, so what it still spends over the first
is kernels compiled again after the cache dropped them.

--by-shape: for the projection shapes of Gemma 3 270M and SmolLM2-135M, the call size the
prefill's probe keeps (block_rows: rows that vary beside others are multiplied in calls of
that many) and the time of 1,024 rows in calls of 256, 128 and 64 rows.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine_core.platforms.cpu.prefill_matmuls import (  # noqa: E402
    RowBucketedLinear,
    block_rows,
)

SHAPES = [(128, 256), (128, 128), (128, 512), (256, 128), (128, 512)]  # (in, out)
MODEL_SHAPES = {"Gemma 3 270M": [(640, 1536), (640, 4096), (1024, 640), (2048, 640)],
                "SmolLM2-135M": [(576, 960), (576, 3072), (1536, 576), (576, 576)]}


def by_shape() -> None:
    for model, shapes in MODEL_SHAPES.items():
        for k, n in shapes:
            w = torch.randn(n, k).to(torch.bfloat16)
            x = torch.randn(1024, k).to(torch.bfloat16)
            ms = []
            for b in (256, 128, 64):
                torch.nn.functional.linear(x[:b], w)
                t = time.perf_counter()
                for _ in range(5):
                    for i in range(0, 1024, b):
                        torch.nn.functional.linear(x[i:i + b], w)
                ms.append(f"{b}: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms")
            kept = block_rows(k, n, torch.bfloat16, False)
            print(f"{model} {k}x{n}: the probe keeps {kept}; 1,024 rows in calls of "
                  + ", ".join(ms), flush=True)


def run(linears: list[nn.Module], rows: list[int], inputs: dict[int, torch.Tensor]) -> float:
    """CPU ms per step."""
    t = time.thread_time()
    with torch.inference_mode():
        for m in rows:
            for linear in linears:
                linear(inputs[linear.in_features][:m])
    return (time.thread_time() - t) / len(rows) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-rows", type=int, default=600)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--by-shape", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.by_shape:
        by_shape()
        return
    torch.manual_seed(0)
    rng = random.Random(0)
    rows = [rng.randint(1, args.max_rows) for _ in range(args.steps)]
    inputs = {k: torch.randn(args.max_rows, k).to(torch.bfloat16) for k in {k for k, _ in SHAPES}}
    for label, cls in (("torch's own calls", nn.Linear), ("bucketed", RowBucketedLinear)):
        linears = [nn.Linear(k, n, bias=False).to(torch.bfloat16) for k, n in SHAPES]
        for linear in linears:
            linear.__class__ = cls
        passes = [run(linears, rows, inputs) for _ in range(args.passes)]
        print(f"{label:18} ms per step, pass 1..{args.passes}: "
              + ", ".join(f"{p:.2f}" for p in passes), flush=True)


if __name__ == "__main__":
    main()
