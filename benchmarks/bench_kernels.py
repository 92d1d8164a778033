"""Times the paged-attention kernels on representative shapes and prints a table.

On CPU: the fast torch path (what serves here) against the torch reference. On CUDA: the
Triton kernels against the torch path. Model shape: 9 query heads, 3 KV heads, head_dim 64,
block_size 16 (SmolLM2-135M-like).

    python benchmarks/bench_kernels.py                    # fp32 and bf16, with the reference
    python benchmarks/bench_kernels.py --dtype bfloat16 --no-reference
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import benchmark
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kernels import cpu_attention, reference  # noqa: E402
from kernels.testing import make_decode_inputs, make_prefill_inputs  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Case:
    """One benchmark row: a name and the argument tuple every implementation takes."""

    kind: str  # "decode" | "prefill" | "store_kv"
    name: str
    args: tuple


def make_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = []
    for num_seqs, context_len in ((1, 2048), (32, 256), (64, 512)):
        inputs = make_decode_inputs(
            [context_len] * num_seqs, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype
        )
        cases.append(Case("decode", f"{num_seqs}x{context_len}", inputs.to(device).args()))
    for num_seqs, q_len, prefix_len in ((1, 512, 0), (4, 128, 256)):
        inputs = make_prefill_inputs(
            [q_len] * num_seqs,
            [prefix_len] * num_seqs,
            NUM_Q_HEADS,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            dtype,
        )
        name = f"{num_seqs}x{q_len}" + (f" +{prefix_len} cached" if prefix_len else "")
        cases.append(Case("prefill", name, inputs.to(device).args()))
    num_tokens = 512
    kv_layer = make_decode_inputs([num_tokens], 3, 3, HEAD_DIM, BLOCK_SIZE, dtype).kv_layer
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    slots = torch.randperm(kv_layer.shape[0] * BLOCK_SIZE)[:num_tokens]
    store_args = (key, key.clone(), kv_layer, slots)
    cases.append(Case("store_kv", f"{num_tokens} tokens", tuple(t.to(device) for t in store_args)))
    return cases


def implementations(device: torch.device) -> dict[str, dict[str, Callable]]:
    """kind -> {label: fn}; the first label is the one being measured, the second the baseline."""
    if device.type == "cuda":
        from kernels.decode_attention import paged_decode_attention_triton
        from kernels.prefill_attention import paged_prefill_attention_triton
        from kernels.store_kv_triton import store_kv_triton

        return {
            "decode": {
                "triton": paged_decode_attention_triton,
                "torch": cpu_attention.paged_decode_attention_torch,
            },
            "prefill": {
                "triton": paged_prefill_attention_triton,
                "torch": cpu_attention.paged_prefill_attention_torch,
            },
            "store_kv": {"triton": store_kv_triton, "torch": cpu_attention.store_kv_torch},
        }
    return {
        "decode": {
            "torch": cpu_attention.paged_decode_attention_torch,
            "reference": reference.paged_decode_attention_ref,
        },
        "prefill": {
            "torch": cpu_attention.paged_prefill_attention_torch,
            "reference": reference.paged_prefill_attention_ref,
        },
        "store_kv": {"torch": cpu_attention.store_kv_torch, "reference": reference.store_kv_ref},
    }


def time_ms(fn: Callable, args: tuple, min_run_time: float, device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(lambda: fn(*args))
    timer = benchmark.Timer("fn(*args)", globals={"fn": fn, "args": args})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def time_once_ms(fn: Callable, args: tuple) -> float:
    """One call, for the slow reference (its Python loops dwarf any timer noise)."""
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), action="append")
    parser.add_argument("--no-reference", action="store_true", help="skip the slow baseline")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per timing")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impls = implementations(device)

    jobs = [
        (dtype_name, case)
        for dtype_name in args.dtype or ["float32", "bfloat16"]
        for case in make_cases(DTYPES[dtype_name], device)
    ]
    rows = []
    for dtype_name, case in tqdm(jobs, desc="benchmarking", leave=False):
        (label, fn), (base_label, base_fn) = impls[case.kind].items()
        ms = time_ms(fn, case.args, args.min_run_time, device)
        base_ms = None
        if not args.no_reference:
            if device.type == "cuda":
                base_ms = time_ms(base_fn, case.args, args.min_run_time, device)
            else:
                base_ms = time_once_ms(base_fn, case.args)
        rows.append((case.kind, case.name, dtype_name, label, ms, base_label, base_ms))

    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__}")
    header = f"{'kernel':9} {'shape':22} {'dtype':9} {'impl':8} {'ms':>9}  {'baseline':10} {'ms':>10} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for kind, name, dtype_name, label, ms, base_label, base_ms in rows:
        base = f"{base_label:10} {base_ms:10.2f} {base_ms / ms:7.1f}x" if base_ms else ""
        print(f"{kind:9} {name:22} {dtype_name:9} {label:8} {ms:9.3f}  {base}")


if __name__ == "__main__":
    main()
