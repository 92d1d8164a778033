"""`pdserve up`: the whole disaggregated stack on this machine, one command.

    pdserve up [--prefill N] [--decode M] [--transport auto|grpc|shm] [--model PATH]

starts N prefill and M decode workers and a gateway as separate processes (workers on free
ports, the gateway on 127.0.0.1:50051 / HTTP 8000 unless told otherwise), pins the prefill and
decode pools to disjoint CPU cores when there are at least two, waits until every process is
ready, prints the addresses, and on Ctrl-C / SIGTERM stops the gateway first (it drains), then
the workers; the exit code is 0 only if every process exited with 0 by itself. If any process
dies, everything is stopped and the exit code is non-zero.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from gateway.cli import add_admission_arguments
from pdserve.worker_args import (
    add_decode_activations_argument,
    add_speculative_arguments,
    speculative_argv,
)

READY_TIMEOUT_S = 600.0  # the first run may download the model
STOP_TIMEOUT_S = 20.0


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--transport", default="auto", choices=["auto", "grpc", "shm"],
                   help="KV transport (auto: shared memory on one host)")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_decode_activations_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="the gateway's interface")
    p.add_argument("--port", type=int, default=50051, help="gateway gRPC port (0: any free)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0: any free)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="per worker")
    p.add_argument("--max-num-seqs", type=int, default=64, help="per decode worker")
    p.add_argument("--no-pin", action="store_true", help="do not pin pools to CPU cores")
    add_admission_arguments(p)  # passed to the gateway
    add_speculative_arguments(p)  # passed to the decode workers


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    address: str | None = None
    metrics_url: str | None = None  # its Prometheus /metrics (workers; printed at start)
    lines: queue.Queue = field(default_factory=queue.Queue)


def split_cores(cores: list[int]) -> tuple[list[int] | None, list[int] | None]:
    """Disjoint core sets for the prefill and decode pools (None: no pinning possible)."""
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def _spawn(name: str, argv: list[str], cores: list[int] | None) -> Child:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))  # torch's thread pool = the pinned cores
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    child = Child(name, proc)
    threading.Thread(target=_pump, args=(child,), daemon=True).start()
    return child


def _pump(child: Child) -> None:
    """Forward a child's output, prefixed; ready lines also go to the waiter."""
    for line in child.proc.stdout:
        child.lines.put(line)
        print(f"[{child.name}] {line}", end="", flush=True)
    child.lines.put(None)


def _wait_ready(child: Child, marker: str, deadline: float) -> str:
    while True:
        try:
            line = child.lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{child.name} was not ready in {READY_TIMEOUT_S:.0f} s") from None
        if line is None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.wait()} before "
                               f"it was ready (its output is above)")
        if line.startswith("METRICS "):
            child.metrics_url = line.split()[2]
        if line.startswith(marker):
            return line


def _stop(children: list[Child]) -> bool:
    """SIGTERM each child in turn and wait for it (killed after STOP_TIMEOUT_S). True if every
    child exited with code 0 by itself; otherwise says which did not."""
    is_clean = True
    for c in children:  # the gateway is first: it drains before the workers go
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
            try:
                c.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
                print(f"pdserve up: {c.name} did not stop within {STOP_TIMEOUT_S:.0f} s; "
                      f"killed", file=sys.stderr, flush=True)
                is_clean = False
                continue
        if c.proc.returncode != 0:
            print(f"pdserve up: {c.name} exited with code {c.proc.returncode}", file=sys.stderr,
                  flush=True)
            is_clean = False
    return is_clean


def run(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise ValueError(f"--prefill and --decode must be >= 1, got {args.prefill} and "
                         f"{args.decode}")
    from engine_core.model_files import resolve_model

    resolve_model(args.model)  # fetch the default model once, with a progress bar, up front
    common = [a for a in (["--model", args.model] if args.model else [])
              + (["--dtype", args.dtype] if args.dtype else [])
              + ["--decode-activations", args.decode_activations]]
    cores = sorted(os.sched_getaffinity(0))
    pre_cores, dec_cores = (None, None) if args.no_pin else split_cores(cores)
    print(f"pdserve up: {args.prefill} prefill (cores {pre_cores or 'any'}) + {args.decode} "
          f"decode (cores {dec_cores or 'any'}), transport {args.transport}", flush=True)
    workers: list[Child] = []
    children: list[Child] = []  # stop order: the gateway first, then the workers
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    kv = ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    is_stopped = False
    try:
        for i in range(args.prefill):
            workers.append(_spawn(f"prefill-{i}", ["prefill", "--port", "0", "--metrics-port",
                                                   "0", *kv, *common], pre_cores))
            children.append(workers[-1])
        transports = "grpc" if args.transport == "grpc" else "grpc,shm"
        for i in range(args.decode):
            workers.append(_spawn(f"decode-{i}", [
                "decode", "--port", "0", "--metrics-port", "0", "--transports", transports,
                "--max-num-seqs",
                str(args.max_num_seqs), *kv, *speculative_argv(args), *common], dec_cores))
            children.append(workers[-1])
        deadline = time.monotonic() + READY_TIMEOUT_S
        for w in workers:
            w.address = _wait_ready(w, "READY ", deadline).split()[2]
        prefill = [w.address for w in workers if w.name.startswith("prefill")]
        decode = [w.address for w in workers if w.name.startswith("decode")]
        gateway = _spawn("gateway", [
            "gateway", "--prefill", *prefill, "--decode", *decode, "--transport",
            args.transport, "--host", args.host, "--port", str(args.port), "--http-port",
            str(args.http_port), "--lease-ttl", str(args.lease_ttl),
            "--max-waiting", str(args.max_waiting), "--max-queue-wait", str(args.max_queue_wait),
            *common], None)
        children.insert(0, gateway)
        line = _wait_ready(gateway, "pdserve gateway:", deadline)
        http_url = line.split("HTTP ")[1].split()[0]
        metrics = [f"{http_url}/metrics"] + [w.metrics_url or "?" for w in workers]
        print(f"pdserve up: ready. {line.removeprefix('pdserve gateway: ').strip()}\n"
              f"  prefill workers: {' '.join(prefill)}\n  decode workers:  {' '.join(decode)}\n"
              f"  metrics: {' '.join(metrics)}\n"
              f"  try: pdserve generate --chat \"What is the capital of France?\"", flush=True)
        while not stopping.is_set():
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"pdserve up: {dead[0].name} exited with code {dead[0].proc.returncode}; "
                      f"stopping everything", file=sys.stderr, flush=True)
                return 1
            stopping.wait(0.5)
        print("pdserve up: stopping", flush=True)
        is_stopped = True
        return 0 if _stop(children) else 1
    finally:
        if not is_stopped:
            _stop(children)
