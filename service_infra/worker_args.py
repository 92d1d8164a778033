"""Flags of `pdserve prefill` and `pdserve decode`, free of heavy imports (fast CLI start)."""

from __future__ import annotations

import argparse
import os

from kv_transfer import transports
from service_infra.tls import add_tls_arguments
from service_infra.tracing import add_tracing_argument


def add_decode_activations_argument(p) -> None:
    """--decode-activations, for every command that decodes on the CPU."""
    p.add_argument("--decode-activations", default="auto", choices=["auto", "float32", "int8"],
                   help="what the CPU's 4/8-bit decode matmuls multiply: float32 activations, "
                        "or int8 ones (one scale per 32, as llama.cpp; needs AVX-512 VNNI); "
                        "auto: int8 for bfloat16 on a VNNI CPU, else float32")


def add_quantization_argument(p) -> None:
    """--quantization (vLLM's flag), for every command that loads a model."""
    p.add_argument("--quantization", default="none", choices=["none", "int8"],
                   help="none: compute the weights as loaded (a GGUF's 4/5/6/8-bit blocks as "
                        "stored, float weights as floats); int8: also requantize float "
                        "weights (safetensors, a GGUF's F32/F16/BF16 tensors) to int8 per 32 "
                        "for the CPU's decode rows: faster decode, slightly different output")


def add_prefill_weights_argument(p) -> None:
    """--prefill-weights, for every command that loads a model on the CPU
    (engine_core/model_loader.py load_model)."""
    p.add_argument("--prefill-weights", default="auto", choices=["auto", "dense", "quantized"],
                   help="what a GGUF's prefill rows multiply on the CPU: a dense copy of its "
                        "4/8-bit weights in the model dtype (fast, about twice the memory), "
                        "or the blocks themselves as llama.cpp does (the weights take about "
                        "the file's size); auto: quantized where the dense copies would not "
                        "fit in the memory available")


def add_cache_decoded_blocks_argument(p) -> None:
    """--cache-decoded-blocks / --no-cache-decoded-blocks (engine_core/engine_config.py
    CacheConfig.cache_decoded_blocks). On by default for the engines that serve: a chat's next
    turn then finds the previous reply's KV where it was decoded (decode-side prefix routing
    sends it back there), as vLLM's and SGLang's prefix caches do. The offline LLM keeps
    prefill-computed blocks only."""
    p.add_argument("--cache-decoded-blocks", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="also serve prefix-cache hits from blocks holding generated tokens, so "
                        "a follow-up turn skips prefilling the previous reply (their KV came "
                        "from decode steps, computed with the 4/8-bit matmuls, so such a hit "
                        "continues slightly differently from a cold prefill of the same "
                        "tokens); --no-cache-decoded-blocks: greedy output depends on the "
                        "tokens only")


def add_kv_offload_arguments(p) -> None:
    """The KV offload tiers (engine_core/kv_offload/), for every command that runs an engine:
    `pdserve up`, `gateway --colocated`, `prefill` and `decode`."""
    g = p.add_argument_group("KV offload tiers (below the KV pool; all off by default)")
    g.add_argument("--kv-offload-cpu-gb", type=float, default=0.0, metavar="N",
                   help="host RAM tier of a CUDA engine (ignored on a CPU engine, whose pool "
                        "is host RAM already)")
    g.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="disk tier: a directory (shared by the workers of a host; a restart "
                        "on the same directory serves its entries)")
    g.add_argument("--kv-offload-disk-gb", type=float, default=16.0, metavar="N",
                   help="the disk tier's budget (least recently used entries evicted)")
    g.add_argument("--kv-offload-redis-url", default=None, metavar="URL",
                   help="remote tier: redis:// or rediss:// (shared across hosts; may be the "
                        "discovery Redis)")
    g.add_argument("--kv-offload-redis-gb", type=float, default=4.0, metavar="N",
                   help="the Redis tier's budget (least recently used entries evicted)")


def kv_offload_argv(args: argparse.Namespace) -> list[str]:
    """The offload flags of `args`, for a command that passes them on to its workers."""
    argv = ["--kv-offload-cpu-gb", str(args.kv_offload_cpu_gb),
            "--kv-offload-disk-gb", str(args.kv_offload_disk_gb),
            "--kv-offload-redis-gb", str(args.kv_offload_redis_gb)]
    if args.kv_offload_dir:
        argv += ["--kv-offload-dir", os.path.abspath(args.kv_offload_dir)]
    if args.kv_offload_redis_url:
        argv += ["--kv-offload-redis-url", args.kv_offload_redis_url]
    return argv


def kv_offload_config(args: argparse.Namespace):
    from engine_core.engine_config import KVOffloadConfig

    return KVOffloadConfig(cpu_gb=args.kv_offload_cpu_gb, disk_dir=args.kv_offload_dir,
                           disk_gb=args.kv_offload_disk_gb,
                           redis_url=args.kv_offload_redis_url,
                           redis_gb=args.kv_offload_redis_gb)


def add_decode_step_arguments(p) -> None:
    """How decode steps run, for every command that runs them (vLLM's flag names)."""
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every decode step eagerly: no CUDA graphs (on CUDA they are "
                        "captured at start, one per batch-size bucket; a CPU has none)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and prepare each step while the one before runs on the "
                        "device (engine_core/async_step.py); default: on with CUDA, off on "
                        "a CPU (nothing to overlap); steps that cannot run ahead (structured "
                        "output, penalties, speculation) run synchronously either way")


def async_scheduling_argv(args: argparse.Namespace) -> list[str]:
    """--async-scheduling as given, for a command that passes it on."""
    value = getattr(args, "async_scheduling", None)
    return [] if value is None else ["--async-scheduling" if value else "--no-async-scheduling"]


def add_worker_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    """Flags shared by `pdserve prefill` and `pdserve decode`."""
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_decode_activations_argument(p)
    add_quantization_argument(p)
    add_prefill_weights_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 in containers")
    p.add_argument("--port", type=int, default=default_port, help="gRPC port (0: any free)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: any free; default: off)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    add_cache_decoded_blocks_argument(p)
    add_kv_offload_arguments(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds in-flight calls may take to finish on shutdown")
    p.add_argument("--advertise-host", default=None,
                   help="host others reach this worker at: registered in Redis, and the "
                        "decode worker's KV transfer address (default: --host; for 0.0.0.0 "
                        "this machine's address)")
    add_redis_arguments(p, is_worker=True)
    add_tls_arguments(p, is_public=False)
    add_tracing_argument(p)


def add_redis_arguments(p: argparse.ArgumentParser, is_worker: bool) -> None:
    """Discovery through Redis (service_infra/redis_registry.py): workers register themselves, the
    gateway finds them. Shared by `pdserve prefill`, `pdserve decode` and `pdserve gateway`."""
    g = p.add_argument_group("discovery (Redis)")
    g.add_argument("--redis-url", default=None, metavar="URL",
                   help="redis://HOST:PORT[/DB], or rediss:// for TLS; "
                        + ("register this worker there (default: no registration)" if is_worker
                           else "find the workers there (instead of --prefill/--decode)"))
    g.add_argument("--redis-password", default=None,
                   help="Redis password (better: the PDSERVE_REDIS_PASSWORD environment "
                        "variable, which is not visible in the process list)")
    g.add_argument("--redis-tls-ca", default=None, metavar="PEM",
                   help="CA certificate that verifies the Redis server (rediss://)")
    g.add_argument("--redis-tls-cert", default=None, metavar="PEM",
                   help="client certificate for Redis servers that require one (rediss://)")
    g.add_argument("--redis-tls-key", default=None, metavar="PEM",
                   help="the client certificate's private key")
    g.add_argument("--redis-namespace", default="pdserve",
                   help="prefix of every key (several deployments can share one Redis)")
    if not is_worker:
        return
    g.add_argument("--worker-id", default=None,
                   help="this worker's name in Redis, stable across restarts (default: the "
                        "POD_NAME environment variable, else ROLE-HOST-PORT)")
    g.add_argument("--registration-ttl", type=float, default=10.0,
                   help="seconds the registration outlives the last heartbeat (sent every "
                        "third of it): how long a dead worker stays listed")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative decoding flags (the colocated engine and decode workers)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="propose tokens by n-gram prompt lookup or with a draft model")
    g.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="draft tokens verified per step")
    g.add_argument("--draft-model", default=None,
                   help="the draft's GGUF file or HF folder (default: the model's own first "
                        "layers)")
    g.add_argument("--draft-num-layers", type=int, default=None,
                   help="layers of the draft to run (self-speculative default: a quarter)")


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The speculative flags of `args` as command-line arguments (for child processes)."""
    if getattr(args, "speculative", None) is None:
        return []
    argv = ["--speculative", args.speculative,
            "--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.draft_model:
        argv += ["--draft-model", args.draft_model]
    if args.draft_num_layers:
        argv += ["--draft-num-layers", str(args.draft_num_layers)]
    return argv


def speculative_config(args: argparse.Namespace):
    if getattr(args, "speculative", None) is None:
        return None
    from engine_core.engine_config import SpeculativeConfig

    return SpeculativeConfig(method=args.speculative,
                             num_speculative_tokens=args.num_speculative_tokens,
                             draft_model=args.draft_model,
                             draft_num_layers=args.draft_num_layers)


def engine_configs(args: argparse.Namespace, **load: object) -> dict:
    """A worker's engine configs from its flags (LLMEngine's arguments by name); `load`
    overrides LoadConfig fields (a prefill worker's quantize_decode and settled
    prefill_weights)."""
    from engine_core.engine_config import CacheConfig, DeviceConfig, LoadConfig, SchedulerConfig

    return dict(
        load_config=LoadConfig(**{
            "model": args.model, "dtype": args.dtype,
            "decode_activations": args.decode_activations, "quantization": args.quantization,
            "prefill_weights": args.prefill_weights, **load}),
        device_config=DeviceConfig(
            enforce_eager=getattr(args, "enforce_eager", False),  # decode workers' flags
            async_scheduling=getattr(args, "async_scheduling", None)),
        cache_config=CacheConfig(kv_cache_memory_gb=args.kv_cache_memory_gb,
                                 cache_decoded_blocks=args.cache_decoded_blocks,
                                 offload=kv_offload_config(args)),
        scheduler_config=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_model_len=args.max_model_len),
        speculative_config=speculative_config(args),
    )


KV_PUSH_MODES = ("layerwise", "after-forward")


def add_prefill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-waiting", type=int, default=256,
                   help="prompts that may wait in this worker's queue at once; one more gets "
                        "RESOURCE_EXHAUSTED and the gateway tries another prefill worker")
    p.add_argument("--kv-push", default="layerwise", choices=KV_PUSH_MODES,
                   help="when a prompt's KV leaves for the decode worker: each layer as soon "
                        "as it is computed, overlapping the later layers (layerwise), or all "
                        "layers once the forward is done (after-forward: the baseline the "
                        "overlap is measured against, benchmarks/bench_shaped_link.py)")


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    add_speculative_arguments(p)
    add_decode_step_arguments(p)
    p.add_argument("--transports", default="auto",
                   help=f"KV transports this worker accepts, comma-separated "
                        f"({', '.join(transports.names())}); auto: grpc,shm on CPU, "
                        f"grpc,cuda_ipc on CUDA (shm is a host-memory pool, so a CUDA worker "
                        f"refuses it)")
