"""`pdserve up`: the whole disaggregated stack on this machine, one command.

    pdserve up [--prefill N] [--decode M] [--transport auto|grpc|shm|cuda_ipc] [--model PATH]

starts N prefill and M decode workers and a gateway as separate processes (workers on free
ports, the gateway on 127.0.0.1:50051 / HTTP 8000 unless told otherwise), pins the prefill and
decode pools to disjoint CPU cores when there are at least two, waits until every process is
ready, and prints the addresses. Then it supervises (pdserve/supervisor.py):

- a process that dies is restarted at its old ports after a backoff (1 s, doubling, at most
  30 s), and the log says so; meanwhile the gateway serves on the workers that are left and
  retries or migrates the dead worker's requests;
- a process that exits --max-restarts times (5) within 300 s stops the stack (exit code 1);
- Ctrl-C / SIGTERM stops the gateway first (it drains), then the workers; the exit code is 0
  only if every process exited with 0 by itself;
- if `pdserve up` itself dies (SIGKILL, OOM), its children get SIGKILL: no worker outlives it
  holding its ports.
A worker that fails to start the first time stops everything at once (the model or a flag
is wrong; restarting would not help).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from gateway.cli import (
    add_admission_arguments,
    add_api_servers_argument,
    add_canary_arguments,
    add_chat_template_argument,
    add_prefill_policy_arguments,
    add_reasoning_parser_argument,
    add_served_model_name_argument,
)
from kv_transfer import transports
from pdserve.supervisor import Child, RestartPolicy, supervise
from service_infra.tracing import add_tracing_argument
from service_infra.worker_args import (
    add_cache_decoded_blocks_argument,
    add_decode_activations_argument,
    add_decode_step_arguments,
    add_kv_offload_arguments,
    add_prefill_weights_argument,
    add_quantization_argument,
    add_speculative_arguments,
    async_scheduling_argv,
    kv_offload_argv,
    speculative_argv,
)

READY_TIMEOUT_S = 600.0  # the first run may download the model
STOP_TIMEOUT_S = 20.0


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    add_tracing_argument(p)  # passed to every process it starts
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--transport", default="auto", choices=["auto", *transports.names()],
                   help="KV transport (auto: shared memory on one host's CPUs, CUDA IPC "
                        "between its GPUs, else grpc)")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_chat_template_argument(p)  # passed to the gateway
    add_reasoning_parser_argument(p)  # passed to the gateway
    add_served_model_name_argument(p)  # passed to the gateway
    add_decode_activations_argument(p)
    add_quantization_argument(p)
    add_prefill_weights_argument(p)  # auto: chosen here, once for every worker's copy
    p.add_argument("--host", default="127.0.0.1", help="the gateway's interface")
    p.add_argument("--port", type=int, default=50051, help="gateway gRPC port (0: any free)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0: any free)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="per worker")
    add_cache_decoded_blocks_argument(p)  # passed to the decode workers
    add_kv_offload_arguments(p)  # passed to every worker
    p.add_argument("--max-num-seqs", type=int, default=64, help="per decode worker")
    p.add_argument("--no-pin", action="store_true", help="do not pin pools to CPU cores")
    p.add_argument("--max-restarts", type=int, default=RestartPolicy.max_crashes,
                   help=f"a process that exits this many times within "
                        f"{RestartPolicy.window_s:.0f} s stops the stack (each exit before "
                        f"that is restarted, with backoff)")
    add_admission_arguments(p)  # passed to the gateway
    add_prefill_policy_arguments(p)  # passed to the gateway
    add_canary_arguments(p)  # passed to the gateway
    add_api_servers_argument(p)  # passed to the gateway
    add_speculative_arguments(p)  # passed to the decode workers
    add_decode_step_arguments(p)  # passed to the decode workers


def split_cores(cores: list[int]) -> tuple[list[int] | None, list[int] | None]:
    """Disjoint core sets for the prefill and decode pools (None: no pinning possible)."""
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return cores[:half], cores[half:]


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class Stack:
    """The children of one `pdserve up` and what their ready lines taught: the ports a
    restart binds again."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workers: list[Child] = []
        self.gateway: Child | None = None
        self.addresses: dict[str, str] = {}  # worker name -> host:port (first ready line)
        self.metrics_ports: dict[str, int] = {}
        self.gateway_ports: tuple[int, int] = (args.port, args.http_port)
        self.started: dict[str, float] = {}  # name -> when its latest process was spawned

    @property
    def children(self) -> list[Child]:
        """Stop order: the gateway first (it drains), then the workers."""
        return [c for c in [self.gateway, *self.workers] if c is not None]

    def add_worker(self, name: str, argv: list[str], cores: list[int] | None) -> Child:
        def worker_argv() -> list[str]:
            port = _port(self.addresses[name]) if name in self.addresses else 0
            return [argv[0], "--port", str(port), "--metrics-port",
                    str(self.metrics_ports.get(name, 0)), *argv[1:]]

        child = Child(name, worker_argv, cores, "READY ")
        self.workers.append(child)
        self.spawn(child)
        return child

    def add_gateway(self, argv: list[str]) -> Child:
        def gateway_argv() -> list[str]:
            grpc_port, http_port = self.gateway_ports
            return ["gateway", *argv, "--port", str(grpc_port), "--http-port", str(http_port)]

        self.gateway = Child("gateway", gateway_argv, None, "pdserve gateway:")
        self.spawn(self.gateway)
        return self.gateway

    def spawn(self, child: Child) -> None:
        self.started[child.name] = time.monotonic()
        child.spawn(self._on_ready)

    def _on_ready(self, child: Child) -> None:
        """From the child's output thread: learn its ports; announce a restarted child."""
        line = child.ready_line
        if child is self.gateway:
            grpc_addr, http_url = line.split("gRPC ")[1].split()[0], line.split("HTTP ")[1]
            self.gateway_ports = (_port(grpc_addr), _port(http_url.split()[0]))
            address = grpc_addr
        else:
            address = line.split()[2]
            self.addresses.setdefault(child.name, address)
            if child.metrics_url:
                self.metrics_ports.setdefault(child.name, _port(child.metrics_url.split("/")[2]))
        if child.crash_times:
            took = time.monotonic() - child.crash_times[-1]
            print(f"pdserve up: {child.name} is serving again at {address} (pid "
                  f"{child.proc.pid}), {took:.1f} s after it exited", flush=True)

    def stop(self) -> bool:
        """Stop every child (the gateway first). True if each exited with 0 by itself."""
        return all([c.stop(STOP_TIMEOUT_S) for c in self.children])


def prefill_weights(args: argparse.Namespace, source) -> str:
    """--prefill-weights for the workers. "auto" is settled here, for all of them at once:
    each worker holds its own copy of the weights, so the dense copies must fit
    (prefill + decode) times over (platforms/cpu/weights.resolve_prefill_weights)."""
    import torch

    from engine_core.platforms import resolve_dtype
    from engine_core.platforms.cpu.weights import dense_copy_bytes, settle_prefill_weights

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    if (args.prefill_weights == "quantized" and source.kind != "gguf"
            and dense_copy_bytes(source, dtype) == 0):  # before any worker starts
        raise ValueError(f"--prefill-weights quantized reads 4/8-bit blocks (a GGUF's, or a "
                         f"checkpoint's MXFP4 experts); {source.path} is a safetensors model "
                         f"without them (use dense or auto)")
    return settle_prefill_weights(args.prefill_weights, source, dtype,
                                  num_copies=args.prefill + args.decode)


def run(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise ValueError(f"--prefill and --decode must be >= 1, got {args.prefill} and "
                         f"{args.decode}")
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import read_chat_template
    from gateway.disagg.canary import CanaryConfig
    from gateway.disagg.prefill_policy import PrefillPolicy

    PrefillPolicy(args.prefill_policy, args.local_prefill_max_tokens)  # bad flags fail here
    CanaryConfig(args.canary_idle_s, args.canary_timeout_s, args.canary_failures)

    if args.chat_template:
        read_chat_template(args.chat_template)  # a bad file fails here, before any worker
    source = resolve_model(args.model)  # fetch the default model once, up front
    common = [a for a in (["--model", args.model] if args.model else [])
              + (["--dtype", args.dtype] if args.dtype else [])
              + (["--otlp-traces-endpoint", args.otlp_traces_endpoint]
                 if args.otlp_traces_endpoint else [])
              + ["--decode-activations", args.decode_activations,
                 "--quantization", args.quantization,
                 "--prefill-weights", prefill_weights(args, source)]]
    cores = sorted(os.sched_getaffinity(0))
    pre_cores, dec_cores = (None, None) if args.no_pin else split_cores(cores)
    print(f"pdserve up: {args.prefill} prefill (cores {pre_cores or 'any'}) + {args.decode} "
          f"decode (cores {dec_cores or 'any'}), transport {args.transport}", flush=True)
    stack = Stack(args)
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    kv = ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb), *kv_offload_argv(args)]
    # the decode workers accept grpc beside a transport named ("grpc,shm"), or their default
    accepted = args.transport if args.transport in ("auto", "grpc") else f"grpc,{args.transport}"
    try:
        for i in range(args.prefill):
            stack.add_worker(f"prefill-{i}", ["prefill", *kv, *common], pre_cores)
        for i in range(args.decode):
            stack.add_worker(f"decode-{i}", [
                "decode", "--transports", accepted, "--max-num-seqs", str(args.max_num_seqs),
                *kv, *speculative_argv(args), *common,
                "--cache-decoded-blocks" if args.cache_decoded_blocks
                else "--no-cache-decoded-blocks",
                *(["--enforce-eager"] if args.enforce_eager else []),
                *async_scheduling_argv(args)], dec_cores)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for w in stack.workers:  # a worker that cannot start once will not start again
            w.wait_ready(deadline)
        prefill = [stack.addresses[w.name] for w in stack.workers if w.name.startswith("pre")]
        decode = [stack.addresses[w.name] for w in stack.workers if w.name.startswith("dec")]
        gateway = stack.add_gateway([
            "--prefill", *prefill, "--decode", *decode, "--transport", args.transport,
            "--host", args.host, "--lease-ttl", str(args.lease_ttl),
            "--max-waiting", str(args.max_waiting), "--max-queue-wait", str(args.max_queue_wait),
            "--prefill-policy", args.prefill_policy,
            "--local-prefill-max-tokens", str(args.local_prefill_max_tokens),
            "--canary-idle-s", str(args.canary_idle_s),
            "--canary-timeout-s", str(args.canary_timeout_s),
            "--canary-failures", str(args.canary_failures),
            "--max-num-choices", str(args.max_num_choices),
            "--api-servers", str(args.api_servers),
            "--reasoning-parser", args.reasoning_parser, *common,
            *(["--served-model-name", *args.served_model_name]
              if args.served_model_name else []),
            *(["--chat-template", os.path.abspath(args.chat_template)]
              if args.chat_template else [])])
        line = gateway.wait_ready(deadline)
        http_url = line.split("HTTP ")[1].split()[0]
        metrics = [f"{http_url}/metrics"] + [w.metrics_url or "?" for w in stack.workers]
        pids = " ".join(f"{c.name}={c.proc.pid}" for c in stack.children)
        print(f"pdserve up: ready. {line.removeprefix('pdserve gateway: ').strip()}\n"
              f"  prefill workers: {' '.join(prefill)}\n  decode workers:  {' '.join(decode)}\n"
              f"  metrics: {' '.join(metrics)}\n  pids: {pids}\n"
              f"  try: pdserve generate --chat \"What is the capital of France?\"", flush=True)
        code = supervise(stack.children, stopping, RestartPolicy(max_crashes=args.max_restarts),
                         stack.spawn)
        if code is not None:
            return code
        print("pdserve up: stopping", flush=True)
        return 0 if stack.stop() else 1
    finally:
        for c in stack.children:  # after a failed start or a crash loop
            if c.is_running:
                c.stop(STOP_TIMEOUT_S)
