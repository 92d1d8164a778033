"""Multi-turn chats: TTFT and ITL of conditional prefill (`--prefill-policy auto`) against
always-remote (and, with --colocated, the colocated engine), on the same workers in one run.

    python benchmarks/bench_multiturn.py [--conversations 8] [--rounds 2] [--colocated]
                                         [--up-args=--cache-decoded-blocks]

It starts `pdserve up --prefill-policy auto` (1 prefill + 1 decode worker, pools pinned to
separate cores) and a second gateway over the same workers with `--prefill-policy
always-remote`. Each round runs every configuration once, in alternating order, on fresh
conversations: `--conversations` chats at once, each of 4-8 turns (a 40-60-token opener, then
short follow-ups such as "Why?"), every turn greedy with up to `--max-tokens` tokens and
sent after the previous answer arrived, with that answer in its history. TTFT is measured
at the client (request sent -> first token), ITL between tokens. Follow-up turns (2 and
later) are what conditional prefill is for; turn 1 is reported apart. Results go to
bench_results/multiturn/results.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

OPENERS = [
    "I am planning a long walk along the coast next spring, starting from a small fishing "
    "village and following the cliffs north for about a week. What should I pack?",
    "My sourdough bread keeps coming out dense and flat even though the starter bubbles "
    "nicely and I follow the recipe carefully. What could be going wrong with it?",
    "Explain how a refrigerator moves heat from its inside to the kitchen, as if I were a "
    "curious twelve-year-old who likes taking things apart.",
    "I have to give a five-minute talk to my team about why we should write tests before "
    "fixing bugs. Help me structure it so that it is short and convincing.",
    "What are the main differences between a lake and a reservoir, and why do engineers "
    "care about how quickly sediment fills a reservoir?",
    "Suggest a simple weekly plan for someone who wants to start running but has never "
    "run more than a kilometre without stopping.",
]
FOLLOW_UPS = ["Why?", "Give one more tip.", "Can you say that more briefly?", "And then?",
              "What is the most common mistake?", "Thanks. Anything else?", "Explain the "
              "second point.", "Give an example."]


def _read_until(proc: subprocess.Popen, prefix: str, what: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise RuntimeError(f"{what} did not start:\n{''.join(lines[-40:])}")


def start_stack(extra: list[str]) -> tuple[subprocess.Popen, list[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--transport", "shm", "--port", "0",
         "--http-port", "0", "--prefill-policy", "auto", *extra], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    _read_until(proc, "pdserve up: ready.", "pdserve up")
    ready = [next(proc.stdout) for _ in range(2)]  # the prefill and decode worker lines
    prefill = ready[0].split(":", 1)[1].split()
    decode = ready[1].split(":", 1)[1].split()
    return proc, prefill, decode


def start_gateway(*argv: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "gateway", "--port", "0",
                             "--http-port", "0", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    line = _read_until(proc, "pdserve gateway: gRPC", "pdserve gateway")[-1]
    return proc, line.split("gRPC ")[1].split()[0]


def drain(proc: subprocess.Popen) -> None:
    """Keep reading a child's output so that it never blocks on a full pipe."""
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def conversation(stub, tag: str, rng: random.Random, max_tokens: int) -> list[dict]:
    """One chat, turn after turn; a row per turn."""
    messages = [pb.ChatMessage(role="user", content=f"({tag}) {rng.choice(OPENERS)}")]
    rows = []
    for turn in range(rng.randint(4, 8)):
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=messages),
                                 sampling=pb.SamplingParameters(max_tokens=max_tokens,
                                                                temperature=0.0))
        t0 = time.monotonic()
        t_first, stamps, text, last = None, [], [], None
        for msg in stub.Generate(req, timeout=300):
            now = time.monotonic()
            if msg.token_ids:
                t_first = t_first or now
                stamps += [now] * len(msg.token_ids)  # k tokens in one message: k gaps of 0
            text.append(msg.text)
            last = msg
        itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        rows.append({"turn": turn + 1, "ttft_s": t_first - t0, "itl_s": itl,
                     "where": last.timing.prefill_where, "reason": last.timing.prefill_reason,
                     "queue_s": last.timing.queue_s, "prefill_s": last.timing.prefill_s,
                     "kv_transfer_s": last.timing.kv_transfer_s,
                     "cached": last.usage.cached_prompt_tokens,
                     "prompt_tokens": last.usage.prompt_tokens})
        messages += [pb.ChatMessage(role="assistant", content="".join(text)),
                     pb.ChatMessage(role="user", content=rng.choice(FOLLOW_UPS))]
    return rows


def run_config(address: str, tag: str, n: int, seed: int, max_tokens: int) -> list[dict]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    with ThreadPoolExecutor(n) as pool:
        chats = pool.map(lambda i: conversation(stub, f"{tag} {i}", random.Random(seed + i),
                                                max_tokens), range(n))
        return [row for rows in chats for row in rows]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summary(rows: list[dict]) -> dict:
    follow = [r for r in rows if r["turn"] > 1]
    first = [r for r in rows if r["turn"] == 1]
    itl = [g for r in rows for g in r["itl_s"]]
    return {"turns": len(rows), "follow_up_ttft_p50_s": pct([r["ttft_s"] for r in follow], .5),
            "follow_up_ttft_p99_s": pct([r["ttft_s"] for r in follow], .99),
            "first_turn_ttft_p50_s": pct([r["ttft_s"] for r in first], .5),
            "itl_p50_s": pct(itl, .5), "itl_p99_s": pct(itl, .99),
            "local_share": sum(r["where"] == "local" for r in rows) / max(1, len(rows)),
            "mean_follow_up_prompt_tokens": statistics.fmean(
                r["prompt_tokens"] for r in follow) if follow else 0.0,
            "mean_follow_up_cached_tokens": statistics.fmean(
                r["cached"] for r in follow) if follow else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--colocated", action="store_true", help="also the colocated engine")
    p.add_argument("--up-args", default="", help='extra flags for `pdserve up`, e.g. '
                   '--up-args=--cache-decoded-blocks (decode workers keep the replies\' KV too)')
    p.add_argument("--out", default="bench_results/multiturn")
    args = p.parse_args()
    stack, prefill, decode = start_stack(shlex.split(args.up_args))
    drain(stack)
    procs = [stack]
    try:
        remote, remote_addr = start_gateway("--prefill", *prefill, "--decode", *decode,
                                            "--transport", "shm",
                                            "--prefill-policy", "always-remote")
        drain(remote)
        procs.append(remote)
        auto, auto_addr = start_gateway("--prefill", *prefill, "--decode", *decode,
                                        "--transport", "shm", "--prefill-policy", "auto")
        drain(auto)
        procs.append(auto)
        configs = {"conditional": auto_addr, "always-remote": remote_addr}
        if args.colocated:
            colo, colo_addr = start_gateway("--colocated")
            drain(colo)
            procs.append(colo)
            configs["colocated"] = colo_addr
        rows: dict[str, list[dict]] = {name: [] for name in configs}
        for r in range(args.rounds):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in order:
                t0 = time.monotonic()
                rows[name] += run_config(configs[name], f"r{r} {name}", args.conversations,
                                         1000 * r, args.max_tokens)
                print(f"round {r + 1}: {name} done in {time.monotonic() - t0:.1f} s",
                      flush=True)
        results = {"conversations": args.conversations, "rounds": args.rounds,
                   "max_tokens": args.max_tokens, "up_args": args.up_args,
                   "summary": {name: summary(rs) for name, rs in rows.items()}, "rows": rows}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(60)
    s = results["summary"]
    print(f"\n{'config':<15}{'turns':>6}{'follow-up TTFT p50':>20}{'p99':>9}"
          f"{'turn-1 p50':>12}{'ITL p99':>9}{'local':>7}")
    for name, m in s.items():
        print(f"{name:<15}{m['turns']:>6}{m['follow_up_ttft_p50_s'] * 1e3:>17.1f} ms"
              f"{m['follow_up_ttft_p99_s'] * 1e3:>6.0f} ms{m['first_turn_ttft_p50_s'] * 1e3:>9.0f}"
              f" ms{m['itl_p99_s'] * 1e3:>6.1f} ms{100 * m['local_share']:>6.0f}%")
    if "always-remote" in s:
        ratio = s["conditional"]["follow_up_ttft_p50_s"] / s["always-remote"][
            "follow_up_ttft_p50_s"]
        print(f"conditional / always-remote, follow-up TTFT p50: {ratio:.2f} (target <= 0.6)")
        results["follow_up_ttft_p50_ratio"] = ratio
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
