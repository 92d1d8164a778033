"""Flags of `pdserve prefill` and `pdserve decode`, free of heavy imports (fast CLI start)."""

from __future__ import annotations

import argparse


def add_worker_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    """Flags shared by `pdserve prefill` and `pdserve decode`."""
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 in containers")
    p.add_argument("--port", type=int, default=default_port, help="gRPC port (0: any free)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds in-flight calls may take to finish on shutdown")


def engine_kwargs(args: argparse.Namespace) -> dict:
    from engine_core.config import CacheConfig, SchedulerConfig

    return dict(
        model=args.model, dtype=args.dtype,
        cache_config=CacheConfig(kv_cache_memory_gb=args.kv_cache_memory_gb),
        scheduler_config=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_model_len=args.max_model_len),
    )


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="grpc,shm",
                   help="KV transports this worker accepts (grpc, shm, cuda_ipc)")
    p.add_argument("--advertise-host", default=None,
                   help="host prefill workers reach this worker at (default: --host)")
