"""Times the paged-attention kernels on representative shapes and prints a table.

On CPU: the fast torch path against the torch reference, then the C kernels that serve decode
rows here (kernels/csrc, float32) against the torch path they replace: decode attention with
its rope and K/V store, and the 4-bit matmuls of the model's projections. On CUDA: the Triton
kernels against the torch path. Model shape: 9 query heads, 3 KV heads, head_dim 64,
block_size 16, hidden 576, intermediate 1536 (SmolLM2-135M).

    python benchmarks/bench_kernels.py                    # fp32 and bf16, with the reference
    python benchmarks/bench_kernels.py --dtype bfloat16 --no-reference

It prints a table and draws bench_results/kernels/kernels.png.
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
from tests.kernels.attention_inputs import make_decode_inputs, make_prefill_inputs  # noqa: E402

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


def native_cases() -> list[tuple[str, str, Callable, Callable]]:
    """(kind, shape, C kernel, the torch path it replaces) on CPU, float32."""
    from engine_core.model.rope import apply_rope, cos_sin_cache
    from engine_core.platforms.cpu.decode_quant import Int4Matmul, NativeQ4Matmul
    from engine_core.weights.gguf_q4 import Q4Weight
    from kernels import native

    lib = native.load()
    if lib is None:
        return []
    cases = []
    for num_seqs, context_len in ((1, 2048), (32, 256), (64, 512)):
        inputs = make_decode_inputs([context_len] * num_seqs, NUM_Q_HEADS, NUM_KV_HEADS,
                                    HEAD_DIM, BLOCK_SIZE, torch.float32)
        kv_layer = inputs.kv_layer.contiguous()
        tables, lens = inputs.block_tables, inputs.context_lens
        positions = lens.long() - 1
        slots = tables.long().gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE
        slots += positions % BLOCK_SIZE
        cos_sin = cos_sin_cache(HEAD_DIM, 4096, 10000.0, None)[positions]
        qkv = torch.randn(num_seqs, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
        scale = HEAD_DIM**-0.5

        def c_kernel(qkv=qkv, cos_sin=cos_sin, kv_layer=kv_layer, slots=slots, tables=tables,
                     lens=lens, max_len=context_len, scale=scale):
            return native.row_attention(lib, qkv.clone(), cos_sin, kv_layer, slots, tables,
                                           lens, NUM_Q_HEADS, scale, max_len)

        def torch_path(qkv=qkv, cos_sin=cos_sin, kv_layer=kv_layer, slots=slots, tables=tables,
                       lens=lens, scale=scale, n=num_seqs):
            half, heads = HEAD_DIM // 2, NUM_Q_HEADS + NUM_KV_HEADS
            qk, v = qkv.split([heads * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=1)
            qk = apply_rope(qk.view(n, heads, HEAD_DIM), cos_sin[:, None, :half],
                            cos_sin[:, None, half:])
            q, k = qk.split([NUM_Q_HEADS, NUM_KV_HEADS], dim=1)
            cpu_attention.store_kv_torch(k, v.view(n, NUM_KV_HEADS, HEAD_DIM), kv_layer, slots)
            return cpu_attention.paged_decode_attention_torch(q, kv_layer, tables, lens, scale)

        cases.append(("decode+rope", f"{num_seqs}x{context_len}", c_kernel, torch_path))
    g = torch.Generator().manual_seed(0)
    for n, k in ((960, 576), (3072, 576), (576, 1536)):
        w = Q4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                     torch.rand(n, k // 32, generator=g) * 0.01,
                     torch.randn(n, k // 32, generator=g) * 0.1, torch.zeros(n))
        c_mm, torch_mm = NativeQ4Matmul(w, lib), Int4Matmul(w)
        # int8 activations (VNNI build), against the float32-activation C kernel
        i8_mm = NativeQ4Matmul(w, lib, int8=True) if native.has_int8(lib) else None
        for rows in (1, 32):
            x = torch.randn(rows, k, generator=g)
            cases.append(("q4 matmul", f"{rows}x{k} @ {k}x{n}", lambda m=c_mm, x=x: m(x),
                          lambda m=torch_mm, x=x: m(x)))
            if i8_mm is not None:
                cases.append(("q4 matmul int8 x", f"{rows}x{k} @ {k}x{n}",
                              lambda m=i8_mm, x=x: m(x), lambda m=c_mm, x=x: m(x)))
    return cases


def plot(rows: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{kind} {name} {dtype_name}" for kind, name, dtype_name, *_ in rows]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r[4] for r in rows], height=0.4, label="measured")
    ax.barh([i - 0.2 for i in y], [r[6] or 0 for r in rows], height=0.4, label="baseline")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ms per call (log)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def time_ms(fn: Callable, args: tuple, min_run_time: float, device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(lambda: fn(*args))
    # the Timer runs on one thread unless told: give it the threads everything else uses
    timer = benchmark.Timer("fn(*args)", globals={"fn": fn, "args": args},
                            num_threads=torch.get_num_threads())
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
    if device.type == "cpu":
        for kind, name, c_fn, torch_fn in tqdm(native_cases(), desc="C kernels", leave=False):
            rows.append((kind, name, "float32", "C", time_ms(c_fn, (), args.min_run_time, device),
                         "torch", time_ms(torch_fn, (), args.min_run_time, device)))

    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__}")
    header = f"{'kernel':11} {'shape':22} {'dtype':9} {'impl':8} {'ms':>9}  {'baseline':10} {'ms':>10} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for kind, name, dtype_name, label, ms, base_label, base_ms in rows:
        base = f"{base_label:10} {base_ms:10.2f} {base_ms / ms:7.1f}x" if base_ms else ""
        print(f"{kind:11} {name:22} {dtype_name:9} {label:8} {ms:9.3f}  {base}")
    out = Path("bench_results/kernels/kernels.png")
    plot(rows, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
