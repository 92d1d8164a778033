"""Decode speed and memory of the engine on GGUF files of each quant type, CPU defaults.

    python benchmarks/bench_gguf_types.py --types Q4_K Q3_K IQ2_XXS --concurrency 1 8

Each type gets a random Llama of TinyLlama-1.1B's widths (hidden 2048, MLP 5632, 32/4 heads,
vocab 32000; 8 layers by default) written as a GGUF by the tests' writer
(tests/engine_core/tiny_models.py: random blocks for the types gguf cannot write), kept in
--dir. Each file is then loaded in a process of its own (its peak RSS is its own), with the
CPU defaults (bf16, quantized decode, the default activations), and generates --output-len
greedy tokens for --concurrency prompts of 16 random tokens at once. The weights are random,
so the text means nothing; the bytes each step reads are a real file's.

To compare two trees, run it from each with PYTHONPATH set to that tree (the files in --dir
are reused).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: a tree to compare

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
PROMPT_LEN = 16
MAX_SEQS = 8  # tiny_models.engine's batch; its 96 KV blocks of 16 hold 8 x 272 tokens


def write(qtype_name: str, layers: int, folder: Path) -> Path:
    import transformers
    from gguf import GGMLQuantizationType

    from tests.engine_core import tiny_models as tm

    path = folder / f"llama-{layers}l-{qtype_name}.gguf"
    if not path.exists():
        hf = tm.build_hf(transformers.LlamaConfig, folder / "hf", num_hidden_layers=layers,
                         **SHAPE)
        tm.write_gguf(hf, path, qtype=GGMLQuantizationType[qtype_name])
    return path


def peak_rss_bytes() -> int:
    """This process's peak resident memory since its exec (VmHWM: getrusage's ru_maxrss
    keeps the forking parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_one(path: Path, concurrency: list[int], output_len: int, prefill_weights: str) -> dict:
    from tests.engine_core import tiny_models as tm

    t0 = time.perf_counter()
    eng = tm.engine(path, quantize_decode=True, dtype="bfloat16", block_size=16,
                    prefill_weights=prefill_weights)
    out = {"load_s": time.perf_counter() - t0, "tokens_per_s": {}}
    for c in concurrency:
        prompts = tm.prompts(SHAPE["vocab_size"], [PROMPT_LEN] * c)
        tm.greedy(eng, prompts, 4)  # untimed
        t0 = time.perf_counter()
        got = tm.greedy(eng, prompts, output_len)
        out["tokens_per_s"][c] = sum(map(len, got)) / (time.perf_counter() - t0)
    out["peak_rss_gb"] = peak_rss_bytes() / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q3_K", "IQ2_XXS"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-weights", choices=["auto", "dense", "quantized"], default="auto")
    ap.add_argument("--dir", type=Path, default=Path("bench_results/gguf_types"))
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a child: this file only
    args = ap.parse_args()
    if max(args.concurrency) > MAX_SEQS or args.output_len > 256:
        ap.error(f"--concurrency takes up to {MAX_SEQS} (the tests' engine runs that many "
                 f"at once) and --output-len up to 256 (its KV blocks)")
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.concurrency, args.output_len,
                                 args.prefill_weights)))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    header = " ".join(f"{'c=' + str(c) + ' tok/s':>11}" for c in args.concurrency)
    print(f"{'type':<8} {'file MB':>8} {'load s':>7} {'peak RSS GB':>11} {header}")
    for name in args.types:
        path = write(name, args.layers, args.dir)
        child = subprocess.run(
            [sys.executable, __file__, "--one", str(path), "--output-len", str(args.output_len),
             "--prefill-weights", args.prefill_weights, "--concurrency",
             *map(str, args.concurrency)], capture_output=True, text=True, check=True)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        speeds = " ".join(f"{r['tokens_per_s'][str(c)]:>11.1f}" for c in args.concurrency)
        print(f"{name:<8} {path.stat().st_size / 1e6:>8.0f} {r['load_s']:>7.1f} "
              f"{r['peak_rss_gb']:>11.2f} {speeds}", flush=True)


if __name__ == "__main__":
    main()
