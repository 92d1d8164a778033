"""Where a decode step's time goes: the engine's own parts timed inside real steps, and each
C kernel of the step timed alone on the step's shapes.

    OMP_NUM_THREADS=1 python benchmarks/profile_decode_step.py --model gemma3-270m --rows 32

Part 1 runs `rows` requests (prompt_len-token prompts) through prefill, then `steps` decode
steps, and reports the median of each part per step: pd_decode_layers, the lm_head's screen
(the quantized matmul), its top-k, the exact refinement, the sampler, and the rest of
`LLMEngine.step` (scheduling, inputs, outputs: Python). Part 2 times every layer's quantized
matrices (and the lm_head screen) on `rows` random rows, each called repeatedly (its weights
cached, where a step streams them from memory), and one layer's decode attention on random
K/V, so that pd_decode_layers' time splits into its matmuls, attention and the rest.
Times are this thread's CPU time (--wall: the wall clock): on a shared machine the wall clock
also counts the time other processes held the core.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine_core.platforms.cpu import decode_quant  # noqa: E402
from engine_core.sampler import Sampler  # noqa: E402
from kernels import native  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(list)
# this thread's CPU time (with OMP_NUM_THREADS=1 all of a step's work): on a shared machine the
# wall clock also counts the time others' processes held the core
CLOCK = time.thread_time


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(CLOCK() - start)
    return wrapper


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times)


def profile_steps(llm, rows: int, prompt_len: int, steps: int) -> None:
    from engine_core.sampling_params import SamplingParams
    from pdserve.bench_engine import make_prompts

    eng = llm.engine
    head = eng.model.lm_head
    head.quant.forward = timed("lm_head screen (quantized matmul)", head.quant.forward)
    topk = native.topk
    top64, top1 = timed("lm_head top-64 of the screen", topk), timed("sampler argmax", topk)
    native.topk = lambda lib, x, k: (top1 if k == 1 else top64)(lib, x, k)
    head_forward = type(head).forward
    type(head).forward = timed("lm_head total", head_forward)
    layers_call = decode_quant.NativeDecodeLayers.__call__
    decode_quant.NativeDecodeLayers.__call__ = timed("pd_decode_layers (18 layers)", layers_call)
    Sampler.__call__ = timed("sampler", Sampler.__call__)
    runner = eng.runner
    runner.forward = timed("model forward (embed + layers)", runner.forward)
    step = timed("engine step", eng.step)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    for ids in make_prompts(llm.tokenizer, rows, prompt_len, first=1000):
        eng.add_request(ids, params)
    while not any(r.num_output_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    TIMES.clear()
    num = 0
    while eng.has_unfinished_requests():
        step()
        num += 1
    total = statistics.median(TIMES["engine step"])
    print(f"\n{num} decode steps of {rows} rows, medians per step (ms):")
    parts = {name: statistics.median(t) for name, t in TIMES.items()}
    for name, t in parts.items():
        print(f"  {name:<40}{1000 * t:9.2f}  {100 * t / total:5.1f} %")
    refine = parts["lm_head total"] - parts["lm_head screen (quantized matmul)"] - parts[
        "lm_head top-64 of the screen"]
    python = total - parts["model forward (embed + layers)"] - parts["lm_head total"] - parts[
        "sampler"]
    print(f"  {'lm_head refine (gather + bmm + scatter)':<40}{1000 * refine:9.2f}")
    print(f"  {'rest of the step (Python, inputs, embed)':<40}{1000 * python:9.2f}")


def profile_kernels(llm, rows: int, repeats: int, context: int) -> None:
    model = llm.engine.model
    torch.manual_seed(0)
    print(f"\nkernels alone on {rows} random rows (median of {repeats}, ms):")
    total = 0.0
    for name in ("qkv", "o", "gate_up", "down"):
        t = macs = 0.0
        kinds = set()
        for layer in model.layers:
            lin = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
                   "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}[name]
            quant = lin.quant
            x = torch.randn(rows, quant.k)
            t += best_of(lambda q=quant, x=x: q(x), repeats)
            macs += rows * quant.n * quant.k
            kinds.add(quant.kind)
        total += t
        print(f"  {name:<8} kinds {sorted(kinds)} [{quant.n} x {quant.k}], all layers "
              f"{1000 * t:7.2f}   {macs / t / 1e9:6.1f} GMAC/s")
    print(f"  {'layer matmuls, all layers':<45}{1000 * total:7.2f}")
    quant = model.lm_head.quant
    x = torch.randn(rows, quant.k)
    t = best_of(lambda: quant(x), repeats)
    print(f"  lm_head screen kind {quant.kind} [{quant.n} x {quant.k}]  {1000 * t:7.2f}   "
          f"{rows * quant.n * quant.k / t / 1e9:6.1f} GMAC/s")
    t = best_of(lambda: torch.empty(rows, quant.n).fill_(0.0), repeats)
    print(f"  a fresh {rows} x {quant.n} float32 tensor, written  {1000 * t:7.2f}")
    logits = torch.randn(rows, quant.n)
    t = best_of(lambda: native.topk(native.load(), logits, 64), repeats)
    print(f"  top-64 of {rows} x {quant.n} logits  {1000 * t:7.2f}")
    t = best_of(lambda: logits.argmax(dim=1), repeats)
    print(f"  torch argmax of {rows} x {quant.n} logits  {1000 * t:7.2f}")
    attention(llm, rows, repeats, context)


def attention(llm, rows: int, repeats: int, context: int) -> None:
    from tests.kernels.attention_inputs import make_decode_inputs

    cfg = llm.engine.model.config
    kv_dtype = llm.engine.runner.kv_cache.dtype
    inputs = make_decode_inputs([context] * rows, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                16, kv_dtype)
    lib = native.load()
    qkv = torch.randn(rows, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    cos_sin = torch.randn(rows, cfg.head_dim)
    cache = inputs.kv_layer.contiguous()  # [num_blocks, 2, block_size, Hkv, D]
    slots = torch.arange(rows, dtype=torch.int64)
    t = best_of(lambda: native.row_attention(
        lib, qkv.clone(), cos_sin, cache, slots, inputs.block_tables, inputs.context_lens,
        cfg.num_heads, cfg.head_dim**-0.5, context), repeats)
    n = len(llm.engine.model.layers)
    print(f"  decode attention, {rows} rows x {context} positions  {1000 * t:7.3f} x {n} = "
          f"{1000 * t * n:7.2f}")


def main() -> None:
    from engine_core.llm import LLM

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--wall", action="store_true", help="the wall clock, not CPU time")
    args = p.parse_args()
    if args.wall:
        global CLOCK
        CLOCK = time.perf_counter
    llm = LLM(args.model, enable_prefix_caching=False, max_num_seqs=args.rows,
              kv_cache_memory_gb=1.0)
    print(f"torch threads {torch.get_num_threads()}, dtype {llm.engine.dtype}, decode "
          f"activations {llm.engine.decode_activations}, {'wall' if args.wall else 'CPU'} time")
    profile_kernels(llm, args.rows, args.repeats, args.prompt_len + args.steps // 2)
    profile_steps(llm, args.rows, args.prompt_len, args.steps)


if __name__ == "__main__":
    main()
