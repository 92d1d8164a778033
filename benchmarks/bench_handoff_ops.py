"""The host time of each step of the KV handoff's exposed tail, alone, in one process: what is
left after the prefill's last layer (bench_kv_transfer.py measures the tail as a whole).

    python benchmarks/bench_handoff_ops.py --device cuda     # cuda_ipc's steps, on the card
    python benchmarks/bench_handoff_ops.py                   # shm's, on the host

A 2,048-token prompt's last layer in the default model's layout (bf16, 128 blocks of 16,
3 KV heads x 64: 1.57 MB), in a pool of twice its blocks. Steps, in the tail's order:

    gather     the sender's snapshot of the layer (gather_blocks), as send_layer takes it
    scatter    the snapshot into the destination blocks (scatter_blocks) and, on CUDA, the
               session stream drained: one_sided.py's write
    send sum   the sender's checksum of the snapshot (checksum_tensor_as: on CUDA the fused
               Triton kernel and its read-back)
    recv sum   the receiver's checksum of its destination blocks, ids already on the device
               (checksum_blocks_as), as commit() checks the last layer
    floors     on CUDA: a synchronize with nothing queued, the read-back of a ready scalar,
               the checksum of one block (a Triton launch with no work to speak of)
    after peer on CUDA: recv sum again, each call right after another process (a context of
               its own on the same card, as the other end of a one-card handoff) has run a
               checksum of its own and synchronized: the card switching between contexts

Each is called --calls times after a warm-up; the median and 90th percentile of the host's
wall time per call are printed (each call ends with its result on the host, so the device's
time is inside). On the H200 the tail's write and checksum took 0.47 ms and the receiver's
check 0.68 ms (docs/benchmarks.md, KV handoff over cuda_ipc, 2026-11-27): this says which of
these steps that is.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from engine_core.kv_cache.layout import KVLayout  # noqa: E402
from kv_transfer import transports  # noqa: E402
from kv_transfer.blocks import gather_blocks, scatter_blocks  # noqa: E402
from kv_transfer.checksum import checksum_blocks_as, checksum_tensor_as  # noqa: E402


def timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(median, p90) microseconds of fn() on the host."""
    for _ in range(max(3, calls // 10)):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def steps(device: torch.device, prompt_tokens: int) -> dict[str, Callable[[], object]]:
    layout = KVLayout("SmolLM2-135M-Instruct", "bfloat16", block_size=16, num_layers=1,
                      num_kv_heads=3, head_dim=64)
    n = -(-prompt_tokens // layout.block_size)
    src = torch.randn(layout.cache_shape(2 * n)).to(layout.torch_dtype).to(device)
    dst = torch.zeros_like(src)
    src_ids = torch.randperm(2 * n)[:n]
    dst_ids = torch.randperm(2 * n)[:n]
    on_gpu = device.type == "cuda"
    # the ids as each side holds them: tensors on the device under CUDA, lists on the host
    src_index = src_ids.to(device) if on_gpu else src_ids.tolist()
    dst_index = dst_ids.to(device) if on_gpu else dst_ids.tolist()
    kind = transports.get("cuda_ipc" if on_gpu else "shm").checksum_kind
    stream = torch.cuda.Stream(device) if on_gpu else None
    snapshot = gather_blocks(src, 0, src_index)
    spare = None if on_gpu else torch.empty_like(snapshot)

    def gather():
        out = gather_blocks(src, 0, src_index, out=spare)
        if on_gpu:
            torch.cuda.current_stream(device).synchronize()
        return out

    def scatter():
        with torch.cuda.stream(stream):
            scatter_blocks(dst, 0, dst_index, snapshot)
            if stream is not None:
                stream.synchronize()

    out = {"gather": gather, "scatter": scatter,
           "send sum": lambda: checksum_tensor_as(kind, snapshot),
           "recv sum": lambda: checksum_blocks_as(kind, dst[0], dst_index)}
    if on_gpu:
        ready = torch.ones((), device=device)
        one_block = dst_index[:1].clone()
        out["sync, idle"] = lambda: torch.cuda.synchronize(device)
        out["item, ready"] = ready.item
        out["sum of 1 block"] = lambda: checksum_blocks_as(kind, dst[0], one_block)
    return out


def _peer(conn, device: str, numel: int) -> None:
    """The other process: on each message, one checksum of its own tensor, synchronized."""
    kind = transports.get("cuda_ipc").checksum_kind
    t = torch.randn(numel, device=device).to(torch.bfloat16)
    while conn.recv():
        checksum_tensor_as(kind, t)
        conn.send(True)


def after_peer(device: torch.device, prompt_tokens: int, calls: int) -> tuple[float, float]:
    """(median, p90) microseconds of the receiver's checksum right after a peer process's
    kernel on the same card (the handoff's two ends alternate so on one card)."""
    layout = KVLayout("SmolLM2-135M-Instruct", "bfloat16", block_size=16, num_layers=1,
                      num_kv_heads=3, head_dim=64)
    n = -(-prompt_tokens // layout.block_size)
    dst = torch.randn(layout.cache_shape(2 * n), device=device).to(layout.torch_dtype)
    index = torch.randperm(2 * n, device=device)[:n]
    kind = transports.get("cuda_ipc").checksum_kind
    parent, child = mp.get_context("spawn").Pipe()
    peer = mp.get_context("spawn").Process(
        target=_peer, args=(child, str(device), n * layout.block_numel), daemon=True)
    peer.start()
    times = []
    try:
        for i in range(calls + max(3, calls // 10)):
            parent.send(True)
            parent.recv()
            t0 = time.perf_counter()
            checksum_blocks_as(kind, dst[0], index)
            if i >= max(3, calls // 10):
                times.append((time.perf_counter() - t0) * 1e6)
    finally:
        parent.send(False)
        peer.join(30)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host"
    print(f"{name}: the last layer of a {args.prompt_tokens}-token prompt, "
          f"{args.calls} calls each, host microseconds")
    print(f"{'step':<16} {'median':>8} {'p90':>8}")
    for step, fn in steps(device, args.prompt_tokens).items():
        median, p90 = timed(fn, args.calls)
        print(f"{step:<16} {median:>8.1f} {p90:>8.1f}", flush=True)
    if device.type == "cuda":
        median, p90 = after_peer(device, args.prompt_tokens, args.calls)
        print(f"{'after peer':<16} {median:>8.1f} {p90:>8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
