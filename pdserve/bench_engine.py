"""Offline throughput of the engine against transformers `generate`, same model, same run.

    pdserve bench-engine --concurrency 1 8 32 --prompt-len 128 --output-len 128

transformers runs requests one at a time (what `generate` behind a server does); the engine
runs `c` requests at once with continuous batching. Both get prompts of the same length and
produce exactly `output_len` tokens (EOS is ignored), prefix caching off.

Each concurrency runs once untimed (first-use costs of its shapes: oneDNN primitives, kernel
scratch), then `--repeats` timed runs with fresh prompts each; the median is reported. On a
shared 2-core machine single runs of the same build differ by up to ~10 %.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

SEED_TEXT = (
    "The history of computing is a story of people building tools to think faster. Early "
    "mechanical calculators gave way to electronic machines, then to personal computers and "
    "phones, and each step changed how we write, trade, learn and talk to one another. "
)


def make_prompts(tokenizer, n: int, prompt_len: int, first: int = 0) -> list[list[int]]:
    base = tokenizer.encode(SEED_TEXT * (prompt_len // 20 + 2), add_special_tokens=False)
    prompts = []
    for i in range(first, first + n):
        head = tokenizer.encode(f"Request {i}: ", add_special_tokens=False)
        prompts.append((head + base)[:prompt_len])  # distinct heads: no shared prefix blocks
    return prompts


def bench_hf(model_path, dtype, prompts, output_len) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=dtype
    ).eval()

    def generate(ids: list[int], n: int) -> None:
        x = torch.tensor([ids])
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)

    generate(prompts[0], 4)  # untimed, as the engine's first run: first-use costs
    start = time.perf_counter()
    for ids in tqdm(prompts, desc="transformers generate (one at a time)"):
        generate(ids, output_len)
    elapsed = time.perf_counter() - start
    return {"requests": len(prompts), "seconds": elapsed,
            "output_tokens_per_s": len(prompts) * output_len / elapsed}


def bench_engine(llm, prompts, output_len) -> dict:
    from engine_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    eng = llm.engine
    start = time.perf_counter()
    for ids in prompts:
        eng.add_request(ids, params)
    first_token = None
    steps = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        if first_token is None and outs:
            first_token = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    n = len(prompts)
    decode_time = elapsed - (first_token or 0.0)
    return {"concurrency": n, "seconds": elapsed, "steps": steps,
            "output_tokens_per_s": n * output_len / elapsed,
            "time_to_first_batch_s": first_token,
            "decode_ms_per_step": 1000 * decode_time / max(1, output_len - 1)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    if results.get("transformers"):
        labels.append("transformers\n(1 at a time)")
        values.append(results["transformers"]["output_tokens_per_s"])
    for r in results["engine"]:
        labels.append(f"pdserve engine\n{r['concurrency']} concurrent")
        values.append(r["output_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar(labels, values, color=["#888"] + ["#2a7"] * (len(values) - 1))
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline throughput, {results['model']} ({results['dtype']}), "
                 f"{results['prompt_len']}+{results['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    from engine_core.config import dtype_name
    from engine_core.llm import LLM

    torch.manual_seed(0)
    llm = LLM(args.model, dtype=args.dtype, decode_activations=args.decode_activations,
              enable_prefix_caching=False,
              max_num_seqs=max(args.concurrency), kv_cache_memory_gb=1.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype_name(llm.engine.dtype)  # what "auto" resolved to on this machine
    results = {"model": llm.engine.source.name, "dtype": dtype,
               "quantize_decode": llm.engine.runner.decode_rows is not None,
               "decode_activations": llm.engine.decode_activations,
               "prompt_len": args.prompt_len, "output_len": args.output_len,
               "torch_threads": torch.get_num_threads(), "machine": platform.processor(),
               "engine": [], "transformers": None}
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    runs = [(c, i) for c in args.concurrency for i in range(args.repeats + 1)]
    timed: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    for c, i in tqdm(runs, desc="engine runs (each concurrency: 1 untimed + repeats)"):
        # distinct prompts per run: no run finds another's blocks (prefix caching is off too)
        prompts = make_prompts(llm.tokenizer, c, args.prompt_len, first=i * c)
        result = bench_engine(llm, prompts, args.output_len)
        if i > 0:
            timed[c].append(result)
    for c in args.concurrency:
        ordered = sorted(timed[c], key=lambda r: r["output_tokens_per_s"])
        median = dict(ordered[len(ordered) // 2])
        median["runs_tokens_per_s"] = [r["output_tokens_per_s"] for r in timed[c]]
        results["engine"].append(median)
    if not args.skip_hf:
        prompts = make_prompts(llm.tokenizer, args.hf_requests, args.prompt_len)
        results["transformers"] = bench_hf(llm.engine.source.path, llm.engine.dtype, prompts,
                                           args.output_len)
    base = results["transformers"]["output_tokens_per_s"] if results["transformers"] else None
    print(f"\n{'system':<34}{'tok/s':>10}{'x transformers':>16}")
    if base:
        print(f"{'transformers generate, 1 at a time':<34}{base:>10.1f}{1.0:>16.1f}")
    for r in results["engine"]:
        ratio = f"{r['output_tokens_per_s'] / base:>16.1f}" if base else ""
        r["ratio_vs_transformers"] = r["output_tokens_per_s"] / base if base else None
        runs = " / ".join(f"{x:.1f}" for x in r["runs_tokens_per_s"])
        print(f"{'engine, ' + str(r['concurrency']) + ' concurrent':<34}"
              f"{r['output_tokens_per_s']:>10.1f}{ratio}   (median of {runs})")
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out_dir / "throughput.png")
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'throughput.png'}")
    return 0
