"""Offline throughput of the engine against transformers `generate`, same model, same run.

    pdserve bench-engine --concurrency 1 8 32 --prompt-len 128 --output-len 128
    pdserve bench-engine --concurrency 32 --skip-hf --sampling greedy \
        temperature=1.0,top_p=0.95 temperature=0.7,top_k=50,repetition_penalty=1.1

transformers runs requests one at a time (what `generate` behind a server does); the engine
runs `c` requests at once with continuous batching. Both get prompts of the same length and
produce exactly `output_len` tokens (EOS is ignored), prefix caching off.

Round 0 runs every concurrency and one short transformers request untimed (first-use costs
of every shape), then each of `--repeats` rounds times every concurrency on fresh prompts and
then transformers. Reported: the median run of each, and the median of the rounds' ratios
(each engine run against the transformers run of its own round), by the wall clock and per
second of each side's process CPU time. On this shared 2-core
machine single runs of the same build differ by up to ~10 % from one minute to the next.

`--sampling` runs every concurrency once per sampling setting in each round ("greedy", or
SamplingParams fields as `name=value,...`); with "greedy" among them, each other setting also
gets the median of its rounds' ratios against greedy at the same concurrency, by the wall
clock and per second of the process's CPU time (which others' load on a shared machine moves
much less). transformers runs greedy.
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


class HFGenerate:
    """transformers' own loading of the same model (a GGUF file or a safetensors folder), on
    the engine's device, `generate` one request at a time."""

    def __init__(self, source, dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        from engine_core.weights.gguf_file import transformers_parses_plainly

        if source.kind == "gguf":
            folder, kw = source.path.parent, {"gguf_file": source.path.name}
        else:
            folder, kw = source.path, {}
        with transformers_parses_plainly():
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kw)
        self.model = model.to(device).eval()

    def generate(self, ids: list[int], n: int) -> None:
        x = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)

    def bench(self, prompts, output_len) -> dict:
        cpu_start = time.process_time()
        start = time.perf_counter()
        for ids in prompts:
            self.generate(ids, output_len)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        n = len(prompts) * output_len
        return {"requests": len(prompts), "seconds": elapsed, "output_tokens_per_s": n / elapsed,
                "cpu_seconds": cpu, "output_tokens_per_cpu_s": n / cpu}


GREEDY = "greedy"
SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                   "repetition_penalty": float, "presence_penalty": float,
                   "frequency_penalty": float, "seed": int}


def parse_sampling(spec: str) -> dict:
    """`greedy` or `name=value,...` of SamplingParams fields -> those fields (validated)."""
    from engine_core.sampling_params import SamplingParams

    if spec == GREEDY:
        return {"temperature": 0.0}
    fields = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep or name not in SAMPLING_FIELDS:
            raise ValueError(f"--sampling {spec!r}: expected 'greedy' or name=value,... with "
                             f"names among {', '.join(SAMPLING_FIELDS)}; got {item!r}")
        try:
            fields[name] = SAMPLING_FIELDS[name](value)
        except ValueError:
            kind = "an integer" if SAMPLING_FIELDS[name] is int else "a number"
            raise ValueError(f"--sampling {spec!r}: {name} must be {kind}, got {value!r}"
                             ) from None
    SamplingParams(**fields)  # the field's bound, named, if a value is out of it
    return fields


def bench_engine(llm, prompts, output_len, sampling: dict | None = None) -> dict:
    from engine_core.sampling_params import SamplingParams

    fields = {"temperature": 0.0, **(sampling or {})}
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **fields)
    eng = llm.engine
    cpu_start = time.process_time()
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
    cpu = time.process_time() - cpu_start
    n = len(prompts)
    decode_time = elapsed - (first_token or 0.0)
    return {"concurrency": n, "seconds": elapsed, "steps": steps,
            "output_tokens_per_s": n * output_len / elapsed,
            # per second of this process's CPU time (all its threads): the work a run took,
            # which others' load on a shared machine moves much less than the wall clock
            "cpu_seconds": cpu, "output_tokens_per_cpu_s": n * output_len / cpu,
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
    several = len({r["sampling"] for r in results["engine"]}) > 1
    for r in results["engine"]:
        label = f"pdserve engine\n{r['concurrency']} concurrent"
        if several:
            label += "\n" + r["sampling"].replace(",", "\n")
        labels.append(label)
        values.append(r["output_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(labels)), 4.5 + 0.6 * several))
    colors = ["#888"] * len(labels)
    for i, r in enumerate(results["engine"], start=len(labels) - len(results["engine"])):
        colors[i] = "#2a7" if r["sampling"] == GREEDY else "#27a"
    bars = ax.bar(labels, values, color=colors)
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline throughput, {results['model']} ({results['dtype']}), "
                 f"{results['prompt_len']}+{results['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput, with every run's throughput beside it."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    median = dict(ordered[len(ordered) // 2])
    median["runs_tokens_per_s"] = [r["output_tokens_per_s"] for r in runs]
    return median


def run(args: argparse.Namespace) -> int:
    from engine_core.config import dtype_name
    from engine_core.llm import LLM

    torch.manual_seed(0)
    try:
        samplings = {spec: parse_sampling(spec) for spec in args.sampling}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise SystemExit(f"--device must be cpu or cuda (cuda:N), got {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
    llm = LLM(args.model, dtype=args.dtype, device=str(device),
              decode_activations=args.decode_activations, enable_prefix_caching=False,
              quantization=args.quantization,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
              max_num_seqs=max(args.concurrency),
              kv_cache_memory_gb=1.0, prefill_weights=args.prefill_weights)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype_name(llm.engine.dtype)  # what "auto" resolved to on this machine
    results = {"model": llm.engine.source.name, "dtype": dtype,
               "quantize_decode": llm.engine.runner.quantization is not None,
               "quantization": llm.engine.quantization or "none",
               "decode_activations": llm.engine.decode_activations,
               "prefill_weights": llm.engine.prefill_weights,
               "decode_mode": llm.engine.decode_mode,
               "prompt_len": args.prompt_len, "output_len": args.output_len,
               "torch_threads": torch.get_num_threads(), "machine": platform.processor(),
               "device": str(llm.engine.device),
               "gpu": (torch.cuda.get_device_name(llm.engine.device)
                       if llm.engine.device.type == "cuda" else None),
               "engine": [], "transformers": None}
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    hf_dtype = getattr(torch, args.hf_dtype) if args.hf_dtype else llm.engine.dtype
    results["transformers_dtype"] = dtype_name(hf_dtype)
    hf = None if args.skip_hf else HFGenerate(llm.engine.source, hf_dtype, llm.engine.device)
    hf_prompts = make_prompts(llm.tokenizer, args.hf_requests, args.prompt_len)
    # round 0 is untimed (first-use costs of every shape: oneDNN primitives, kernel scratch);
    # each later round times every sampling setting and concurrency and then transformers, so
    # that a ratio compares runs a few seconds apart: this machine's speed drifts by ~10 %
    # within minutes
    points = [(spec, c) for spec in samplings for c in args.concurrency]
    timed: dict[tuple[str, int], list[dict]] = {point: [] for point in points}
    hf_runs: list[dict] = []
    first = 0
    for i in tqdm(range(args.repeats + 1), desc="rounds (1 untimed + repeats)"):
        for spec, c in points:
            # distinct prompts per run: no run reuses another's blocks (prefix caching is off)
            first += c
            prompts = make_prompts(llm.tokenizer, c, args.prompt_len, first=first)
            result = bench_engine(llm, prompts, args.output_len, samplings[spec])
            result["sampling"] = spec
            if i > 0:
                timed[spec, c].append(result)
        if hf is not None:
            if i == 0:
                hf.generate(hf_prompts[0], 4)
            else:
                hf_runs.append(hf.bench(hf_prompts, args.output_len))
    if hf_runs:
        results["transformers"] = median_run(hf_runs)
    base = results["transformers"]["output_tokens_per_s"] if hf_runs else None
    for spec, c in points:
        r = median_run(timed[spec, c])
        if hf_runs:  # the median of each round's ratio against the transformers run beside it
            ratios = sorted(e["output_tokens_per_s"] / h["output_tokens_per_s"]
                            for e, h in zip(timed[spec, c], hf_runs, strict=True))
            r["ratios_vs_transformers"] = ratios
            r["ratio_vs_transformers"] = ratios[len(ratios) // 2]
            # per second of CPU time: on a shared machine, what each would make on the cores
            # it got (with one thread each, OMP_NUM_THREADS=1, the fairest comparison there)
            cpu_ratios = sorted(e["output_tokens_per_cpu_s"] / h["output_tokens_per_cpu_s"]
                                for e, h in zip(timed[spec, c], hf_runs, strict=True))
            r["cpu_ratios_vs_transformers"] = cpu_ratios
            r["cpu_ratio_vs_transformers"] = cpu_ratios[len(cpu_ratios) // 2]
        if GREEDY in samplings and spec != GREEDY:  # against greedy, round by round
            ratios = sorted(e["output_tokens_per_s"] / g["output_tokens_per_s"]
                            for e, g in zip(timed[spec, c], timed[GREEDY, c], strict=True))
            r["ratios_vs_greedy"] = ratios
            r["ratio_vs_greedy"] = ratios[len(ratios) // 2]
            cpu_ratios = sorted(e["output_tokens_per_cpu_s"] / g["output_tokens_per_cpu_s"]
                                for e, g in zip(timed[spec, c], timed[GREEDY, c], strict=True))
            r["cpu_ratios_vs_greedy"] = cpu_ratios
            r["cpu_ratio_vs_greedy"] = cpu_ratios[len(cpu_ratios) // 2]
        results["engine"].append(r)
    print(f"\n{'system (median of ' + str(args.repeats) + ' rounds)':<34}{'sampling':<48}"
          f"{'tok/s':>10}{'x transformers':>16}{'x greedy':>10}   runs")
    if base:
        hf_list = " / ".join(f"{x:.1f}" for x in results["transformers"]["runs_tokens_per_s"])
        print(f"{'transformers generate, 1 at a time':<34}{GREEDY:<48}{base:>10.1f}"
              f"{1.0:>16.1f}{'':>10}   {hf_list}")
    on_cpu = device.type == "cpu"  # a GPU's work is not its process's CPU time
    for r in results["engine"]:
        ratio = f"{r['ratio_vs_transformers']:>16.1f}" if base else f"{'':>16}"
        vs_greedy = f"{r['ratio_vs_greedy']:>10.2f}" if "ratio_vs_greedy" in r else f"{'':>10}"
        runs = " / ".join(f"{x:.1f}" for x in r["runs_tokens_per_s"])
        if base:
            runs += "   (x " + " / ".join(f"{x:.1f}" for x in r["ratios_vs_transformers"]) + ")"
        print(f"{'engine, ' + str(r['concurrency']) + ' concurrent':<34}{r['sampling']:<48}"
              f"{r['output_tokens_per_s']:>10.1f}{ratio}{vs_greedy}   {runs}")
        if "cpu_ratio_vs_transformers" in r and on_cpu:
            cpu = " / ".join(f"{x:.1f}" for x in r["cpu_ratios_vs_transformers"])
            print(f"{'':<34}{'  per CPU second, x transformers':<48}{'':>10}"
                  f"{r['cpu_ratio_vs_transformers']:>16.1f}{'':>10}   {cpu}")
        if "cpu_ratio_vs_greedy" in r and on_cpu:
            cpu = " / ".join(f"{x:.2f}" for x in r["cpu_ratios_vs_greedy"])
            print(f"{'':<34}{'  per CPU second, x greedy':<48}{'':>10}{'':>16}"
                  f"{r['cpu_ratio_vs_greedy']:>10.2f}   {cpu}")
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out_dir / "throughput.png")
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'throughput.png'}")
    return 0
