"""What the GPU path does on the card at hand, in one run (prints a table, writes JSON):

1. the card's own device-to-device copy bandwidth, the yardstick for what follows;
2. the Triton paged decode attention, 32 sequences x 2048 tokens of context, bf16, on
   SmolLM2-135M's heads (9 query, 3 KV, head_dim 64) and on Llama-3-8B's (32, 8, 128): the
   KV bytes it reads per second, against the copy bandwidth; a row without splitting the
   context (1 split), one with the split count the kernel picks for the card (auto) and one
   with twice that (kernels/decode_split.py). Each is timed twice: replayed in a CUDA graph,
   as the engine's decode steps run it (the kernel's own time: the bandwidth figure), and
   launched eagerly from Python (that time includes the host's launch cost whenever the
   launch takes longer than the kernel);
3. the engine on CUDA, bf16, on a model of SmolLM2-135M's shapes with random weights (the
   weights' values don't change the speed): output tokens/s at each concurrency, 128-token
   prompts, 128 output tokens, against transformers `generate` of the same model one request
   at a time; greedy and sampled (T=1, top_p 0.95, top_k 50) at each concurrency.

    python benchmarks/bench_gpu.py                  # needs CUDA
    python benchmarks/bench_gpu.py --concurrency 1 32 --out bench_results/gpu
    python benchmarks/bench_gpu.py --attention-only   # 1 and 2 only, in seconds
    python benchmarks/bench_gpu.py --attention-only --sweep   # and the decode kernel's
                                    # launch choices (tile, warps, stages), the best first

The KV handoff over cuda_ipc is measured by benchmarks/bench_kv_transfer.py --device cuda.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from tests.kernels.attention_inputs import make_decode_inputs  # noqa: E402
from tests.tiny_model import SMOLLM2_SHAPE, write_tiny_llama  # noqa: E402

HEADS = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() / (ms / 1e3)


def auto_splits(num_seqs: int, num_kv_heads: int) -> int:
    """What PDSERVE_DECODE_SPLITS=auto (the default) chooses."""
    from kernels.decode_split import ENV, num_context_splits

    before = os.environ.get(ENV)
    os.environ[ENV] = "auto"
    try:
        return num_context_splits(num_seqs, num_kv_heads, torch.device("cuda"))
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def kernel_ms(fn, rep: int = 100) -> tuple[float, float]:
    """(ms a call replayed in a CUDA graph, ms a call launched eagerly), medians. The graph's
    figure is the kernels' own time, as the engine's decode graphs run them; the eager one
    is bounded below by the host's launch cost, which for a ~50 us kernel can dominate."""
    from triton.testing import do_bench, do_bench_cudagraph

    graph = do_bench_cudagraph(fn, rep=rep, return_mode="median")
    eager = do_bench(fn, warmup=10, rep=rep, return_mode="median")
    return graph, eager


def decode_attention(num_seqs: int, context: int) -> list[dict]:
    from kernels.decode_attention import paged_decode_attention_triton

    rows = []
    for name, (hq, hkv, d) in HEADS.items():
        inputs = make_decode_inputs([context] * num_seqs, hq, hkv, d, 16, torch.bfloat16)
        args = inputs.to("cuda").args()
        auto = auto_splits(num_seqs, hkv)
        for label, splits in (("1", 1), (f"auto={auto}", auto), (f"2xauto={2 * auto}", 2 * auto)):
            ms, eager_ms = kernel_ms(lambda args=args, splits=splits:
                                     paged_decode_attention_triton(*args, num_splits=splits),
                                     rep=200)
            kv_bytes = num_seqs * context * hkv * d * 2 * 2  # K and V, bf16
            rows.append({"heads": name, "num_seqs": num_seqs, "context": context,
                         "splits": label, "ms": ms, "eager_ms": eager_ms, "kv_bytes": kv_bytes,
                         "gbytes_per_s": kv_bytes / (ms / 1e3) / 1e9})
    return rows


SWEEP = {"block_n": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4)}


def decode_attention_sweep(num_seqs: int, context: int, copy: float) -> list[dict]:
    """The unsplit decode kernel over SWEEP's launch choices, per head shape; then the best
    choice with the split counts of decode_attention(). Rows sorted fastest first per shape."""
    import itertools

    from kernels.decode_attention import paged_decode_attention_triton

    rows = []
    for name, (hq, hkv, d) in HEADS.items():
        inputs = make_decode_inputs([context] * num_seqs, hq, hkv, d, 16, torch.bfloat16)
        args = inputs.to("cuda").args()
        kv_bytes = num_seqs * context * hkv * d * 2 * 2
        auto = auto_splits(num_seqs, hkv)
        shape_rows = []
        for block_n, warps, stages in itertools.product(*SWEEP.values()):
            launch = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
            try:
                ms, eager_ms = kernel_ms(lambda a=args, k=launch: paged_decode_attention_triton(
                    *a, num_splits=1, **k), rep=40)
            except Exception as e:  # e.g. out of shared memory for this tile and depth
                print(f"  {name} {launch}: {type(e).__name__}", flush=True)
                continue
            shape_rows.append({"heads": name, "splits": 1, **launch, "ms": ms,
                               "eager_ms": eager_ms,
                               "pct_of_copy": 100 * kv_bytes / (ms / 1e3) / copy})
            print(f"  {name} {launch}: {ms * 1e3:.1f} us in a graph "
                  f"({shape_rows[-1]['pct_of_copy']:.1f} %), {eager_ms * 1e3:.1f} us eager",
                  flush=True)
        shape_rows.sort(key=lambda r: r["ms"])
        best = {k: shape_rows[0][k] for k in SWEEP}
        for splits in sorted({auto, 2 * auto, 4 * auto} - {1}):
            ms, eager_ms = kernel_ms(lambda a=args, k=best, s=splits:
                                     paged_decode_attention_triton(*a, num_splits=s, **k),
                                     rep=40)
            shape_rows.append({"heads": name, "splits": splits, **best, "ms": ms,
                               "eager_ms": eager_ms,
                               "pct_of_copy": 100 * kv_bytes / (ms / 1e3) / copy})
        rows += sorted(shape_rows, key=lambda r: r["ms"])
    return rows


def engine(folder: Path, concurrency: list[int], prompt_len: int, output_len: int) -> dict:
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams

    llm = LLM(model=str(folder), dtype="bfloat16", device="cuda", kv_cache_memory_gb=8.0,
              enable_prefix_caching=False, max_num_seqs=max(concurrency))
    greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=output_len, temperature=1.0, top_p=0.95, top_k=50,
                             ignore_eos=True)

    def prompts(n: int, first: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(first)
        return torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (n, prompt_len), generator=g).tolist()

    for params in (greedy, sampled):  # compile every kernel shape once
        llm.generate(prompts(max(concurrency), 0), params)
    out = {}
    for c in concurrency:
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts(c, c), params)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            out[f"{name} c={c}"] = {"seconds": seconds,
                                    "output_tokens_per_s": c * output_len / seconds}
    return out


def hf_generate(folder: Path, prompt_len: int, output_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    x = torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (1, prompt_len), device="cuda")

    def run() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run()
    seconds = min(run() for _ in range(2))
    return {"seconds": seconds, "output_tokens_per_s": output_len / seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "gpu")
    p.add_argument("--attention-only", action="store_true",
                   help="copy bandwidth and decode attention only, no engine runs")
    p.add_argument("--sweep", action="store_true",
                   help="also time the decode kernel's launch choices (about a minute)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    card = torch.cuda.get_device_name()
    copy = copy_bandwidth()
    print(f"{card}: device-to-device copy {copy / 1e9:.0f} GB/s (read + write)", flush=True)
    attn = decode_attention(32, 2048)
    for r in attn:
        print(f"decode attention {r['heads']:13} {r['num_seqs']}x{r['context']} "
              f"splits {r['splits']:10}: "
              f"{r['ms'] * 1e3:8.1f} us/layer in a graph, {r['gbytes_per_s']:7.0f} GB/s KV read = "
              f"{100 * r['gbytes_per_s'] * 1e9 / copy:5.1f} % of the copy bandwidth; "
              f"{r['eager_ms'] * 1e3:8.1f} us launched eagerly", flush=True)
    sweep = decode_attention_sweep(32, 2048, copy) if args.sweep else []
    for name in HEADS if sweep else ():
        print(f"decode attention {name}, 32x2048, the fastest launch choices:")
        for r in [r for r in sweep if r["heads"] == name][:6]:
            print(f"  block_n {r['block_n']:3} warps {r['num_warps']} stages {r['num_stages']} "
                  f"splits {r['splits']:2}: {r['ms'] * 1e3:7.1f} us in a graph, "
                  f"{r['pct_of_copy']:5.1f} % of the copy bandwidth "
                  f"({r['eager_ms'] * 1e3:.1f} us eager)", flush=True)
    eng: dict = {}
    hf: dict = {}
    if not args.attention_only:
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_tiny_llama(Path(tmp), **SMOLLM2_SHAPE)
            eng = engine(folder, args.concurrency, args.prompt_len, args.output_len)
            hf = hf_generate(folder, args.prompt_len, args.output_len)
    for c, r in eng.items():
        print(f"engine {c:12}: {r['output_tokens_per_s']:9.0f} output tokens/s "
              f"({r['output_tokens_per_s'] / hf['output_tokens_per_s']:6.1f}x transformers "
              f"generate, {hf['output_tokens_per_s']:.0f} tokens/s at c=1)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"card": card, "torch": torch.__version__, "copy_bytes_per_s": copy,
              "decode_attention": attn, "decode_attention_sweep": sweep, "engine": eng,
              "transformers_generate": hf,
              "prompt_len": args.prompt_len, "output_len": args.output_len,
              "time": time.strftime("%Y-%m-%d %H:%M")}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
