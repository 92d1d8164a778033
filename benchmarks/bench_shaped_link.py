"""The KV handoff over shaped links: a prefill and a decode worker on hosts of their own
(pdserve/cluster/: network namespaces, links shaped with tc tbf both ways), the default model
on its defaults, transport auto (grpc between hosts). Needs root.

    sudo python benchmarks/bench_shaped_link.py                 # 1, 10, 25 Gbit/s; 1k, 4k
    sudo python benchmarks/bench_shaped_link.py --rates 1 --prompt-tokens 1024 --runs 2

Part 1, for each push mode (layer-wise, the default; after-forward, every layer handed over
once the forward is done: `pdserve prefill --kv-push after-forward`), link rate and prompt
length: `--runs` distinct prompts, one at a time (max_tokens 2), each response's timing
breakdown. Reported (medians): TTFT, the exposed handoff (kv_transfer_s: first token sampled
on the prefill worker to first token delivered by the decode worker), its share of TTFT, the
prefill's compute, the KV's bytes over the link rate (the wire time of the whole KV), and the
pace the prefill worker measured (Status.kv_transfer_bytes_per_s: bytes over first layer
queued -> commit verified, what `auto` prices a transfer with; under the layer-wise push on a
CPU that is the forward's pace, not the link's).

Part 2 (`--auto-rates`, default 10 then 0.01 Gbit/s): the gateway on --prefill-policy auto,
one long stream decoding on the decode worker, and `--auto-prompts` requests of
`--auto-prompt-tokens` at each rate: where each was prefilled, the cost model's two estimates
and the link speed the prefill worker measured. The link only shows in the decision where
its wire time outlasts the prefill it overlaps (a CPU's prefill here is slower than 1 Gbit/s
of KV), hence the 10 Mbit/s step.

Writes bench_results/shaped_link/results.json.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from pdserve.cluster.stack import ClusterSpec, ClusterStack  # noqa: E402
from protos.pdserve.internal import workers_pb2 as wpb  # noqa: E402
from protos.pdserve.internal import workers_pb2_grpc as wpb_grpc  # noqa: E402
from protos.pdserve.v1 import generate_pb2 as pb  # noqa: E402
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

VOCAB = 49152  # the default model's
rng = random.Random(0)


def prompt(n: int) -> list[int]:
    """n random token ids: no two prompts share a block (no prefix-cache hit anywhere)."""
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def generate(stub, ids: list[int], max_tokens: int = 2) -> pb.Timing:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParameters(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    *_, last = stub.Generate(req, timeout=600)
    return last.timing


def prefill_status(cluster: ClusterStack) -> wpb.WorkerStatus:
    (worker,) = cluster.live("prefill")
    with grpc.insecure_channel(worker.address) as ch:
        return wpb_grpc.PrefillStub(ch).Status(wpb.StatusRequest(), timeout=10)


def shape_all(cluster: ClusterStack, gbit: float) -> None:
    for w in cluster.live():
        cluster.net.shape(w.host, gbit * 1e9)


def spec(model: str, *, prefill_args=(), gateway_args=()) -> ClusterSpec:
    return ClusterSpec(model=model, num_prefill=1, num_decode=1, dtype=None, kv_cache_memory_gb=0.5,
                       lease_ttl_s=30.0, registration_ttl_s=10.0, prefill_args=prefill_args,
                       gateway_args=("--canary-idle-s", "0", *gateway_args))


def part1(model: str, args, workdir: Path) -> list[dict]:
    rows = []
    for push in args.push:
        with ClusterStack(spec(model, prefill_args=("--kv-push", push)), workdir / push) as c:
            stub = pb_grpc.GenerationStub(grpc.insecure_channel(c.grpc_addr))
            bytes_per_token = prefill_status(c).kv_bytes_per_token
            for gbit in args.rates:
                shape_all(c, gbit)
                generate(stub, prompt(256))  # warm-up over this link
                for n in args.prompt_tokens:
                    timings = [generate(stub, prompt(n)) for _ in range(args.runs)]
                    nbytes = -(-n // 16) * 16 * bytes_per_token  # whole blocks move
                    med = {k: statistics.median(getattr(t, k) for t in timings)
                           for k in ("queue_s", "prefill_s", "kv_transfer_s", "ttft_s")}
                    row = {"push": push, "gbit_s": gbit, "prompt_tokens": n, **med,
                           "kv_bytes": nbytes, "wire_s": nbytes * 8 / (gbit * 1e9),
                           "exposed_share": med["kv_transfer_s"] / med["ttft_s"],
                           "measured_gbit_s": prefill_status(c).kv_transfer_bytes_per_s
                           * 8 / 1e9,
                           "runs": [[t.prefill_s, t.kv_transfer_s, t.ttft_s] for t in timings]}
                    rows.append(row)
                    print(f"{push:13} {gbit:5g} Gbit/s {n:5d} tok: TTFT {row['ttft_s']:.3f} s, "
                          f"exposed {row['kv_transfer_s'] * 1e3:.1f} ms "
                          f"({row['exposed_share']:.1%}), prefill {row['prefill_s']:.3f} s, "
                          f"KV {nbytes / 1e6:.1f} MB / link {row['wire_s'] * 1e3:.1f} ms, "
                          f"measured {row['measured_gbit_s']:.2f} Gbit/s", flush=True)
    return rows


def part2(model: str, args, workdir: Path) -> list[dict]:
    rows = []
    gw_args = ("--prefill-policy", "auto", "--local-prefill-max-tokens", "8192")
    with ClusterStack(spec(model, gateway_args=gw_args), workdir / "auto") as c:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(c.grpc_addr))
        stop = threading.Event()

        def decode_stream() -> None:  # one sequence decoding throughout: local prefill stalls it
            while not stop.is_set():  # (whole chunks: the decode worker measures its prefill
                generate(stub, prompt(240), max_tokens=400)  # speed as it is)

        shape_all(c, args.auto_rates[0])
        generate(stub, prompt(256))  # remote ("unmeasured"): the first speeds get measured
        stream = threading.Thread(target=decode_stream, daemon=True)
        stream.start()
        time.sleep(2)
        try:
            for gbit in args.auto_rates:
                shape_all(c, gbit)
                for i in range(args.auto_prompts):
                    t = generate(stub, prompt(args.auto_prompt_tokens))
                    last = httpx.get(f"{c.http_url}/internal/status", timeout=10).json()[
                        "prefill_placement"]["last"]
                    if last["num_local_tokens"] != args.auto_prompt_tokens:  # (not 240)
                        last = {"local_cost_s": None, "remote_cost_s": None}  # the stream's
                    row = {"gbit_s": gbit, "request": i, "where": t.prefill_where,
                           "reason": t.prefill_reason, "ttft_s": t.ttft_s,
                           "local_cost_s": last["local_cost_s"],
                           "remote_cost_s": last["remote_cost_s"],
                           "measured_gbit_s": prefill_status(c).kv_transfer_bytes_per_s
                           * 8 / 1e9}
                    rows.append(row)
                    print(f"auto {gbit:5g} Gbit/s #{i}: {t.prefill_where} ({t.prefill_reason}),"
                          f" local {row['local_cost_s']} s, remote {row['remote_cost_s']} s, "
                          f"link measured {row['measured_gbit_s']:.2f} Gbit/s, "
                          f"TTFT {t.ttft_s:.3f} s", flush=True)
        finally:
            stop.set()
            stream.join(120)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25], help="Gbit/s")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--push", nargs="+", default=["layerwise", "after-forward"],
                   choices=["layerwise", "after-forward"])
    p.add_argument("--auto-rates", type=float, nargs="+", default=[10, 0.01])
    p.add_argument("--auto-prompts", type=int, default=6)
    p.add_argument("--auto-prompt-tokens", type=int, default=256)
    p.add_argument("--skip-part1", action="store_true")
    p.add_argument("--out", default="bench_results/shaped_link")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so that the clusters' networks come down here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from engine_core.model_files import pull_default_model

    model = str(pull_default_model(progress=True))
    with tempfile.TemporaryDirectory(prefix="pdserve-shaped-") as tmp:
        results = {"args": vars(args),
                   "part1": [] if args.skip_part1 else part1(model, args, Path(tmp)),
                   "part2": part2(model, args, Path(tmp)) if args.auto_prompts else []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"written to {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
