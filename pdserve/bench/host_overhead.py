"""`pdserve bench --workload host-overhead`: the host CPU each process spends per streamed
token, beside the offline engine's for the same model, in one run.

    pdserve bench --workload host-overhead                      # the tiny model, c = 256
    pdserve bench --workload host-overhead --baseline-repo ../old-checkout --repeats 2

For each stack (this checkout, and with --baseline-repo a checkout of another commit, run the
same way in the same run and alternated with it, round after round):

1. offline: `LLM.generate` of `concurrency` prompts (max_num_seqs = concurrency) in a process
   of its own; its CPU seconds (all threads) per generated token;
2. served: `pdserve up` with `--max-num-seqs concurrency`, then, per protocol (HTTP SSE
   completions, gRPC Generate), `num_prompts` streamed requests at `concurrency` at once;
   each process's CPU seconds over the load (utime + stime of the gateway, the prefill and
   the decode workers, from /proc) and the load client's own (this process), per streamed
   token; served tokens/s, and its ratio to the offline engine's.

The model defaults to a tiny random Llama (pdserve/bench/tiny_model.py), whose compute is
small: what is left is what the host spends around it. Both sides run it in the CPU's default
dtype (bf16 where the CPU multiplies it natively, else float32), or in `dtype` when given. Every prompt is distinct and every
request generates exactly `output_len` tokens (EOS ignored), greedy.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.client import GREEDY, GrpcClient, HttpClient
from pdserve.bench.runner import Lane, run_lanes
from pdserve.bench.servers import Server, StackOptions
from pdserve.bench.tiny_model import FIRST_WORD, words
from pdserve.bench.workloads import BenchRequest

ROLES = ("gateway", "prefill", "decode")
_PIDS = re.compile(r"^\s*pids: (.+)$", re.MULTILINE)
# the offline measurement, in a process of the stack's own code: only the long-stable API
_OFFLINE = """
import json, sys, time
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
model, c, n_in, n_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, max_num_seqs=c, **({"dtype": sys.argv[6]} if sys.argv[6] else {}))
params = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0)
prompts = json.loads(sys.argv[5])
llm.generate(prompts[:8], params)  # first-use costs
cpu, wall = time.process_time(), time.perf_counter()
outs = llm.generate(prompts, params)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps({"tokens": tokens, "cpu_s": cpu, "wall_s": wall}))
"""


@dataclass(frozen=True)
class HostConfig:
    model: str
    concurrency: int = 256
    num_prompts: int = 512
    input_len: int = 32
    output_len: int = 128
    protocols: tuple[str, ...] = ("http", "grpc")
    repeats: int = 1
    stack_args: tuple[str, ...] = ()
    baseline_repo: Path | None = None
    dtype: str | None = None  # None: each side's default ("auto")


def stacks(cfg: HostConfig) -> dict[str, Path | None]:
    """label -> the checkout whose code runs it (None: this one)."""
    out: dict[str, Path | None] = {"this": None}
    if cfg.baseline_repo is not None:
        out["baseline"] = cfg.baseline_repo.resolve()
    return out


def _env(repo: Path | None) -> tuple[dict[str, str], str | None]:
    """The environment and working directory that make `python -m pdserve` run `repo`'s code
    (it must come before this installation on sys.path, which -m starts with the cwd)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if repo is None:
        return env, None
    import pdserve

    if pdserve.USER_GOMP_SPINCOUNT is None:  # that checkout's own OpenMP default, not ours
        env.pop("GOMP_SPINCOUNT", None)
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env, str(repo)


def requests(cfg: HostConfig, tokenizer, seed: int) -> list[BenchRequest]:
    """Distinct prompts of input_len tokens: random words for the tiny model's word-level
    vocabulary, the `fixed` workload's text for any other model."""
    if tokenizer.decode([FIRST_WORD]) != words([FIRST_WORD]):
        from pdserve.bench.workloads import WorkloadConfig, build_workload

        return build_workload(WorkloadConfig("fixed", cfg.num_prompts, cfg.input_len,
                                             cfg.output_len, seed=seed), tokenizer)["main"]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(cfg.num_prompts):
        ids = tuple(rng.integers(FIRST_WORD, tokenizer.vocab_size, cfg.input_len).tolist())
        out.append(BenchRequest(cfg.output_len, cfg.input_len, ids, words(ids)))
    return out


def offline(cfg: HostConfig, repo: Path | None,
            batch: list[BenchRequest]) -> dict[str, float]:
    env, cwd = _env(repo)
    prompts = [list(r.prompt_ids or ()) for r in batch[:cfg.concurrency]]
    proc = subprocess.run(
        [sys.executable, "-c", _OFFLINE, cfg.model, str(cfg.concurrency), str(cfg.input_len),
         str(cfg.output_len), json.dumps(prompts), cfg.dtype or ""],
        env=env, cwd=cwd, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the offline run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    return {"tokens_per_s": r["tokens"] / r["wall_s"],
            "cpu_us_per_token": 1e6 * r["cpu_s"] / r["tokens"]}


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads) and of its descendants (a gateway's API
    servers, gateway/api_servers.py), seconds."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def stack_pids(log: Path, timeout_s: float = 30.0) -> dict[str, list[int]]:
    """The gateway's and workers' pids as `pdserve up` printed them, by role. (It prints them
    once its gateway's ready line reached it, which can be after the gateway answers health
    checks: they are waited for.)"""
    deadline = time.monotonic() + timeout_s
    while (match := _PIDS.search(log.read_text(errors="replace"))) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"`pdserve up` printed no pids within {timeout_s:.0f} s "
                               f"(log: {log})")
        time.sleep(0.1)
    out: dict[str, list[int]] = {role: [] for role in ROLES}
    for item in match.group(1).split():
        name, _, pid = item.partition("=")
        out[name.split("-")[0]].append(int(pid))
    return out


async def _load(client, requests: list[BenchRequest], cfg: HostConfig,
                pids: dict[str, list[int]]) -> dict[str, Any]:
    before = {role: sum(map(process_cpu_s, p)) for role, p in pids.items()}
    cpu0, t0 = time.process_time(), time.perf_counter()
    results, _ = await run_lanes(client.send, [Lane(requests, cfg.concurrency)], 3600.0,
                                 desc=f"{client.protocol} c={cfg.concurrency}")
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    failed = [r for r in results if not r.is_success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed; first: {failed[0].error}")
    tokens = sum(r.output_len for r in results)
    per_token = {role: 1e6 * (sum(map(process_cpu_s, p)) - before[role]) / tokens
                 for role, p in pids.items()}
    per_token["client"] = 1e6 * client_cpu / tokens
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "cpu_us_per_token": per_token}


def served(cfg: HostConfig, label: str, repo: Path | None, requests: list[BenchRequest],
           out_dir: Path) -> dict[str, Any]:
    env, cwd = _env(repo)
    opts = StackOptions(cfg.model, cfg.dtype, ("--max-num-seqs", str(cfg.concurrency),
                                               *cfg.stack_args))
    server = Server("disagg", opts, out_dir / "logs" / label, env=env, cwd=cwd)
    try:
        target = server.wait_healthy()
        pids = stack_pids(target.log)
        out = {}
        for protocol in cfg.protocols:
            async def run(protocol=protocol) -> dict[str, Any]:
                client = (HttpClient(target.http_url, GREEDY, "completions")
                          if protocol == "http"
                          else GrpcClient(target.grpc_address, GREEDY, "completions"))
                try:
                    await client.send(requests[0])  # warm-up
                    return await _load(client, requests, cfg, pids)
                finally:
                    await client.close()

            out[protocol] = asyncio.run(run())
        return out
    finally:
        server.stop()


def run_host_overhead(cfg: HostConfig, out_dir: Path) -> dict[str, Any]:
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(cfg.model))
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in stacks(cfg)}
    for k in range(cfg.repeats):
        batch = requests(cfg, tokenizer, seed=k)
        order = list(stacks(cfg).items())
        for label, repo in order if k % 2 == 0 else order[::-1]:  # a shared machine drifts
            print(f"pdserve bench: host-overhead round {k + 1}: {label}", flush=True)
            row = {"offline": offline(cfg, repo, batch),
                   "served": served(cfg, label, repo, batch, out_dir)}
            results[label].append(row)
            print(json.dumps({label: row}), flush=True)
    return results


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Medians over the rounds; with a baseline, this ÷ baseline for every column."""
    def med(values) -> float:
        return float(np.median(list(values)))

    lines = [f"{'stack':9} {'proto':5} {'tok/s':>8} {'gateway':>8} {'prefill':>8} "
             f"{'decode':>8} {'client':>8} {'offline':>8} {'served/offline':>14}",
             "  (CPU microseconds per streamed token; offline: the engine's own)"]
    rows: dict[tuple[str, str], list[float]] = {}
    for label, rounds in results.items():
        for proto in rounds[0]["served"]:
            s = [r["served"][proto] for r in rounds]
            values = [med(x["tokens_per_s"] for x in s),
                      *(med(x["cpu_us_per_token"][role] for x in s)
                        for role in (*ROLES, "client")),
                      med(r["offline"]["cpu_us_per_token"] for r in rounds),
                      med(x["tokens_per_s"] / r["offline"]["tokens_per_s"]
                          for x, r in zip(s, rounds, strict=True))]
            rows[(label, proto)] = values
            lines.append(f"{label:9} {proto:5} {values[0]:8.0f} "
                         + " ".join(f"{v:8.1f}" for v in values[1:6]) + f" {values[6]:14.2f}")
    if "baseline" in results:
        for proto in results["this"][0]["served"]:
            a, b = rows[("this", proto)], rows[("baseline", proto)]
            lines.append(f"{'ratio':9} {proto:5} " + " ".join(
                f"{x / y if y else float('nan'):8.2f}" for x, y in zip(a[:6], b[:6],
                                                                        strict=True)))
    return "\n".join(lines)
