"""TTFT of a long prompt: the disaggregated stack (per transport) against the offline engine,
with the KV transfer's share of it.

    python benchmarks/bench_ttft.py [--prompt-len 512] [--requests 5] [--transports shm grpc]

For each transport it starts `pdserve up --transport T` (1 prefill + 1 decode, pools pinned to
separate cores), sends `--requests` distinct prompts of `--prompt-len` tokens one at a time
(max_tokens 2, so the timing includes the first decode step) and reads the timing breakdown
of each response. The offline engine (`LLM`, same dtype, prefix caching off) runs the same
prompts in this process. Medians are printed, written to bench_results/ttft/results.json and
drawn in ttft.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import grpc
from tqdm import tqdm

from kv_transfer import transports
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

WORDS = ["river", "stone", "light", "garden", "paper", "window", "silver", "music", "forest", "engine", "harbor", "quiet", "market", "winter", "orbit", "signal"]


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(length * 2))
        out.append(tokenizer.encode(f"Request {i}. " + text)[:length])  # distinct from token 2
    return out


def offline(ids_list: list[list[int]], dtype: str) -> dict:
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams

    llm = LLM(dtype=dtype, enable_prefix_caching=False)
    llm.generate(ids_list[0][:32], SamplingParams(max_tokens=2))  # warm-up
    ttfts = []
    for ids in tqdm(ids_list, desc="offline engine"):
        out = llm.generate(ids, SamplingParams(max_tokens=2, temperature=0.0))[0]
        ttfts.append(out.metrics["first_token"])
    return {"ttft_s": statistics.median(ttfts)}


def start_stack(transport: str, dtype: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--transport", transport, "--port", "0",
         "--http-port", "0", "--dtype", dtype], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("pdserve up: ready."):
            return proc, line.split("gRPC ")[1].split()[0]
    raise RuntimeError(f"pdserve up --transport {transport} did not start")


def disaggregated(ids_list: list[list[int]], transport: str, dtype: str) -> dict:
    proc, address = start_stack(transport, dtype)
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
        warm = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids_list[0][:32]),
                                  sampling=pb.SamplingParameters(max_tokens=2))
        list(stub.Generate(warm))
        rows = []
        for ids in tqdm(ids_list, desc=f"disaggregated ({transport})"):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParameters(
                max_tokens=2, temperature=0.0))
            t = [m for m in stub.Generate(req)][-1].timing
            rows.append(t)
        med = {k: statistics.median(getattr(r, k) for r in rows)
               for k in ("queue_s", "prefill_s", "kv_transfer_s", "first_decode_step_s",
                         "ttft_s")}
        med["transfer_share_of_ttft"] = statistics.median(
            r.kv_transfer_s / r.ttft_s for r in rows)
        return med
    finally:
        proc.terminate()
        proc.wait(60)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["offline"] + [f"disagg\n{t}" for t in results["disaggregated"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names[0], results["offline"]["ttft_s"], color="#888", label="TTFT (offline)")
    for i, (_t, r) in enumerate(results["disaggregated"].items(), start=1):
        bottom = 0.0
        for key, color in (("queue_s", "#bbb"), ("prefill_s", "#2a7"),
                           ("kv_transfer_s", "#d62")):
            ax.bar(names[i], r[key], bottom=bottom, color=color,
                   label=key if i == 1 else None)
            bottom += r[key]
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"TTFT, {results['prompt_len']}-token prompt ({results['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--transports", nargs="+", default=["shm", "grpc"],
                   choices=transports.names())
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench_results/ttft")
    args = p.parse_args()
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    ids_list = prompts(tokenizer, args.requests, args.prompt_len)
    results = {"prompt_len": args.prompt_len, "requests": args.requests, "dtype": args.dtype,
               "offline": offline(ids_list, args.dtype), "disaggregated": {}}
    for transport in args.transports:
        results["disaggregated"][transport] = disaggregated(ids_list, transport, args.dtype)
    print(f"\n{'path':<22}{'TTFT s':>9}{'prefill s':>11}{'transfer s':>12}{'transfer/TTFT':>15}")
    print(f"{'offline engine':<22}{results['offline']['ttft_s']:>9.3f}")
    for t, r in results["disaggregated"].items():
        print(f"{'disaggregated ' + t:<22}{r['ttft_s']:>9.3f}{r['prefill_s']:>11.3f}"
              f"{r['kv_transfer_s']:>12.4f}{100 * r['transfer_share_of_ttft']:>14.1f}%")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "ttft.png")
    print(f"wrote {out / 'results.json'} and {out / 'ttft.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
