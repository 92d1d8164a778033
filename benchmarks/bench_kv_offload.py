"""A returning chat's time to first token from the KV offload tiers, against recomputing it.

    python benchmarks/bench_kv_offload.py redis [--rounds 3] [--repeat 40]
    python benchmarks/bench_kv_offload.py restart [--repeat 56]
    python benchmarks/bench_kv_offload.py served-redis [--rounds 4] [--repeat 40]

redis: two engines (two prefill workers' engines: the default model and settings) share a
real redis-server on loopback. Engine A prefills a chat and closes; a fresh engine B gets the
same chat. B's time to its first token with the Redis tier (it loads the history) against the
same pair without tiers (it recomputes), rounds in alternating order, medians printed.

served-redis: two `pdserve up` stacks (each a gateway, a prefill worker and a decode worker,
the default model) share one real redis-server as their Redis tier. Each round's chat (a
new one) is sent to one stack, which recomputes it, then to the other, whose prefill worker
loads its history from Redis; the stacks swap roles every round. TTFT to the first content
chunk of a streamed chat completion, medians printed.

restart: `pdserve up --transport shm` (1 prefill + 1 decode) started four times; each time
one streamed chat completion of a long chat, TTFT to the first content chunk. Twice on the
same --kv-offload-dir (the second start finds the first one's entries), then twice without
tiers.

The chat is the printing-press paragraph of tests/e2e/stack.py repeated `--repeat` times.
The engine-level and end-to-end tests of the tiers are tests/engine_core/test_kv_offload_*.py
and tests/e2e/test_e2e_kv_offload.py; the served multi-turn comparison is `pdserve bench
--workload multi-turn --history-len MIN MAX --kv-offload-dir DIR`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tests.e2e.stack import LONG, spawn_stack, stop_stack, wait_stack  # noqa: E402


def bench_redis(rounds: int, repeat: int) -> None:
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams
    from tests.redis_server import run_redis

    one = SamplingParams(max_tokens=1, temperature=0.0)
    times: dict[str, list[float]] = {"redis": [], "recompute": []}
    with run_redis(Path(tempfile.mkdtemp())) as server:
        for r in range(rounds):
            chat = f"Chat {r}. " + " ".join([LONG] * repeat)
            order = ("redis", "recompute") if r % 2 == 0 else ("recompute", "redis")
            for mode in order:
                tiers = {"redis_url": server.url} if mode == "redis" else None
                a = LLM(kv_cache_memory_gb=0.5, kv_offload=tiers)
                a.generate(chat, one)
                a.close()  # its stores are done
                b = LLM(kv_cache_memory_gb=0.5, kv_offload=tiers)
                b.generate("warm up", one)
                t0 = time.monotonic()
                out = b.generate(chat, one)[0]
                times[mode].append(time.monotonic() - t0)
                print(f"round {r + 1} {mode}: {times[mode][-1] * 1e3:.0f} ms "
                      f"({len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} "
                      f"loaded or cached)", flush=True)
                b.close()
    loaded, recomputed = (statistics.median(times[m]) for m in ("redis", "recompute"))
    print(f"median: Redis tier {loaded * 1e3:.0f} ms, recompute {recomputed * 1e3:.0f} ms, "
          f"ratio {loaded / recomputed:.3f}")


def first_token_s(http: str, messages: list[dict]) -> float:
    model = httpx.get(f"{http}/v1/models", timeout=30).json()["data"][0]["id"]
    t0 = time.monotonic()
    with httpx.stream("POST", f"{http}/v1/chat/completions", timeout=600, json={
            "model": model, "messages": messages, "max_tokens": 8, "temperature": 0,
            "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    return time.monotonic() - t0
    raise RuntimeError("the stream ended without content")


def bench_restart(repeat: int) -> None:
    doc = " ".join([LONG] * repeat)
    messages = [{"role": "user", "content": f"Read this.\n\n{doc}\n\nSummarize it in a line."}]
    folder = tempfile.mkdtemp(prefix="kv-offload-")
    for label, extra in (("tier, empty", ["--kv-offload-dir", folder]),
                         ("tier, after a restart", ["--kv-offload-dir", folder]),
                         ("no tier", []), ("no tier, after a restart", [])):
        proc, log = spawn_stack("--transport", "shm", *extra)
        stack = wait_stack(proc, log)
        try:
            print(f"{label}: TTFT {first_token_s(stack.http_url, messages):.2f} s", flush=True)
        finally:
            stop_stack(stack)


def bench_served_redis(rounds: int, repeat: int) -> None:
    from tests.redis_server import run_redis

    times: dict[str, list[float]] = {"redis": [], "recompute": []}
    with run_redis(Path(tempfile.mkdtemp())) as server:
        tier = ["--kv-offload-redis-url", server.url]
        spawned = [spawn_stack("--transport", "shm", *tier) for _ in range(2)]
        stacks = [wait_stack(proc, log) for proc, log in spawned]
        try:
            for r in range(rounds):
                doc = " ".join([LONG] * repeat)
                messages = [{"role": "user", "content": f"Chat {r}. Read this.\n\n{doc}\n\n"
                                                        "Summarize it in a line."}]
                first, then = stacks if r % 2 == 0 else stacks[::-1]
                for mode, stack in (("recompute", first), ("redis", then)):
                    times[mode].append(first_token_s(stack.http_url, messages))
                    print(f"round {r + 1} {mode}: TTFT {times[mode][-1] * 1e3:.0f} ms",
                          flush=True)
                    time.sleep(2.0)  # the stores of its blocks reach Redis (write-through)
        finally:
            for stack in stacks:
                stop_stack(stack)
    loaded, recomputed = (statistics.median(times[m]) for m in ("redis", "recompute"))
    print(f"median: Redis tier {loaded * 1e3:.0f} ms, recompute {recomputed * 1e3:.0f} ms, "
          f"ratio {loaded / recomputed:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["redis", "restart", "served-redis"])
    p.add_argument("--rounds", type=int, default=3, help="redis: rounds")
    p.add_argument("--repeat", type=int, default=None,
                   help="paragraphs in the chat (default: redis 40, about 2k tokens; restart "
                        "56, about 3k)")
    args = p.parse_args()
    if args.mode == "redis":
        bench_redis(args.rounds, args.repeat or 40)
    elif args.mode == "served-redis":
        bench_served_redis(args.rounds, args.repeat or 40)
    else:
        bench_restart(args.repeat or 56)


if __name__ == "__main__":
    main()
