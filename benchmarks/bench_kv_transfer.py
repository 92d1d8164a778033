"""Ships the KV of a 512-token prompt of the default model's layout (30 layers, 3 KV heads x 64,
block 16) from this process to a receiver in another process over loopback, per transport and
dtype, and reports GB/s and seconds. Writes bench_results/kv_transfer/{results.json,plot.png}.

Over shm and cuda_ipc, LayerDone and Commit go over the receiver's Unix socket ("unix", the
default) or gRPC ("grpc", where the socket is out of reach): --controls picks which to run.

Two modes per configuration:
  back-to-back   all layers handed over at once: the transport's throughput
  overlapped     layers handed over --compute-ms apart (a sleep standing in for the prefill of
                 that layer): what the transfer adds to time-to-first-token is commit_seconds,
                 the time from the last layer to the verified commit

    python benchmarks/bench_kv_transfer.py                 # grpc + shm, float32 + bfloat16
    python benchmarks/bench_kv_transfer.py --runs 5 --kinds shm --dtypes bfloat16
    python benchmarks/bench_kv_transfer.py --kinds shm --controls unix   # the default only
    python benchmarks/bench_kv_transfer.py --device cuda --kinds cuda_ipc grpc \
        --dtypes bfloat16 --prompt-tokens 2048           # on a GPU: KV on the device
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from engine_core.kv_cache.layout import KVLayout  # noqa: E402
from kv_transfer import SenderOptions, connect, transports  # noqa: E402
from tests.kv_transfer.loopback import ReceiverProcess  # noqa: E402

PROMPT_TOKENS = 512  # --prompt-tokens; sender and receiver pools hold twice its blocks


def layout_for(dtype: str) -> KVLayout:
    return KVLayout("SmolLM2-135M-Instruct", dtype, block_size=16, num_layers=30,
                    num_kv_heads=3, head_dim=64)


def one_transfer(conn, receiver, src_kv, src_ids, compute_s: float):
    lease_id, dst_ids = receiver.call("open", len(src_ids), 30.0)
    session = conn.begin(lease_id, src_ids, dst_ids)
    for layer in range(conn.layout.num_layers):
        if compute_s:
            time.sleep(compute_s)
        session.send_layer(layer, src_kv)
    stats = session.commit(timeout=30)
    receiver.call("claim", lease_id)
    return stats


def bare_rpc_seconds(target: str, calls: int = 200) -> float:
    """The median unary round trip to the receiver that does no work (an Abort of no lease):
    the floor under the Commit RPC on this host."""
    import grpc

    from protos.pdserve.internal import kv_transfer_pb2 as pb
    from protos.pdserve.internal import kv_transfer_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        request = pb.AbortRequest(lease_id="bench-no-lease", reason="", writer_stopped=True)
        times = []
        for _ in range(calls + 20):  # the first 20: the channel's warm-up
            t = time.perf_counter()
            stub.Abort(request, timeout=5)
            times.append(time.perf_counter() - t)
    return statistics.median(times[20:])


def bench(kind: str, control: str, dtype: str, runs: int, compute_ms: float, bar: tqdm,
          prompt_tokens: int = PROMPT_TOKENS, device: str = "cpu") -> dict:
    layout = layout_for(dtype)
    num_blocks = prompt_tokens // layout.block_size
    pool_blocks = 2 * num_blocks
    gen = torch.Generator().manual_seed(0)
    src_kv = torch.randn(layout.cache_shape(pool_blocks), generator=gen).to(
        layout.torch_dtype).to(device)
    src_ids = torch.randperm(pool_blocks, generator=gen)[:num_blocks].tolist()
    rows = {}
    with ReceiverProcess(layout, pool_blocks, use_shm=kind == "shm",
                         device=device) as receiver, \
            connect(kind, receiver.target, layout, device=device,
                    options=SenderOptions(local_control=control == "unix")) as conn:
        assert (conn.kind, conn.control) == (kind, control)
        for mode, compute_s in (("back-to-back", 0.0), ("overlapped", compute_ms / 1000)):
            one_transfer(conn, receiver, src_kv, src_ids, compute_s)  # warm-up
            stats = []
            for _ in range(runs):
                stats.append(one_transfer(conn, receiver, src_kv, src_ids, compute_s))
                bar.update()
            rows[mode] = summarize(stats)
        bare_rpc_s = bare_rpc_seconds(receiver.target)
    return {"kind": kind, "control": control, "dtype": dtype, "device": device,
            "num_blocks": num_blocks,
            "payload_bytes": stats[0].num_bytes, "bare_rpc_seconds": bare_rpc_s, **rows}


def summarize(stats) -> dict:
    med = statistics.median
    return {
        "seconds": med(s.seconds for s in stats),
        "gbytes_per_s": med(s.gbytes_per_s for s in stats),
        "commit_seconds": med(s.commit_seconds for s in stats),
        "verify_seconds": med(s.verify_seconds for s in stats),
        "commit_rpc_seconds": med(s.commit_rpc_seconds for s in stats),
        "last_layer_shipped_s": med(s.layer_shipped_s[-1] - s.layer_queued_s[-1] for s in stats),
        "runs": len(stats),
    }


def print_table(results: list[dict], compute_ms: float, prompt_tokens: int) -> None:
    print(f"\nKV of a {prompt_tokens}-token prompt, 30 layers x {prompt_tokens // 16} blocks, "
          f"receiver in another process, loopback; medians")
    head = (f"{'transport':9} {'control':7} {'dtype':8} {'MB':>6} | {'b2b s':>7} {'GB/s':>6} {'commit ms':>9} "
            f"{'verify ms':>9} | {'overlap s':>9} {'exposed ms':>10} {'last write':>10} "
            f"{'Commit RPC':>10} {'verify':>6} {'bare RPC':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        b2b, ovl = r["back-to-back"], r["overlapped"]
        print(f"{r['kind']:9} {r['control']:7} {r['dtype']:8} {r['payload_bytes'] / 1e6:6.2f} | "
              f"{b2b['seconds']:7.4f} {b2b['gbytes_per_s']:6.2f} "
              f"{b2b['commit_seconds'] * 1e3:9.1f} {b2b['verify_seconds'] * 1e3:9.1f} | "
              f"{ovl['seconds']:9.3f} {ovl['commit_seconds'] * 1e3:10.2f} "
              f"{ovl['last_layer_shipped_s'] * 1e3:10.2f} {ovl['commit_rpc_seconds'] * 1e3:10.2f} "
              f"{ovl['verify_seconds'] * 1e3:6.2f} {r['bare_rpc_seconds'] * 1e3:8.2f}")
    print(f"b2b: all layers at once. overlap: a {compute_ms:g} ms sleep before each layer; "
          f"exposed = last layer handed over -> verified commit (adds to TTFT), of which: the "
          f"last layer's write and checksum, the Commit RPC sent -> answered, and within it the "
          f"receiver's verification (ms); bare RPC: a unary call that does nothing, the floor "
          f"under the Commit RPC")


def plot(results: list[dict], path: Path, prompt_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['kind']}/{r['control']}\n{r['dtype']}" for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, [r["back-to-back"]["gbytes_per_s"] for r in results], color="tab:blue")
    ax1.set_ylabel("GB/s (back-to-back)")
    ax1.set_title(f"KV transfer throughput, {prompt_tokens}-token prompt")
    exposed = [r["overlapped"]["commit_seconds"] * 1e3 for r in results]
    verify = [r["overlapped"]["verify_seconds"] * 1e3 for r in results]
    ax2.bar(labels, exposed, color="tab:orange", label="exposed (last layer -> commit)")
    ax2.bar(labels, verify, color="tab:red", label="of which checksum verify")
    ax2.set_ylabel("ms added to TTFT (overlapped)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["grpc", "shm"],
                        choices=transports.names())
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--controls", nargs="+", default=["unix", "grpc"],
                        help="shm / cuda_ipc: LayerDone and Commit over the receiver's Unix "
                             "socket, or gRPC (the grpc transport is always grpc)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--compute-ms", type=float, default=10.0)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--device", default="cpu", help="where both ends' KV caches live")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "kv_transfer")
    args = parser.parse_args()
    configs = [(k, c, d) for k in args.kinds
               for c in (args.controls if k != "grpc" else ["grpc"]) for d in args.dtypes]
    results = []
    with tqdm(total=len(configs) * 2 * args.runs, desc="kv transfers") as bar:
        for kind, control, dtype in configs:
            bar.set_postfix_str(f"{kind} {control} {dtype}")
            results.append(bench(kind, control, dtype, args.runs, args.compute_ms, bar,
                                 args.prompt_tokens, args.device))
    print_table(results, args.compute_ms, args.prompt_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"prompt_tokens": args.prompt_tokens, "device": args.device, "compute_ms": args.compute_ms,
            "torch_threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%d %H:%M")}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results},
                                                      indent=2))
    plot(results, args.out / "plot.png", args.prompt_tokens)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'plot.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
