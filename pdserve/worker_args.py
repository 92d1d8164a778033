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
    from engine_core.config import SpeculativeConfig

    return SpeculativeConfig(method=args.speculative,
                             num_speculative_tokens=args.num_speculative_tokens,
                             draft_model=args.draft_model,
                             draft_num_layers=args.draft_num_layers)


def engine_kwargs(args: argparse.Namespace) -> dict:
    from engine_core.config import CacheConfig, SchedulerConfig

    return dict(
        model=args.model, dtype=args.dtype,
        speculative_config=speculative_config(args),
        cache_config=CacheConfig(kv_cache_memory_gb=args.kv_cache_memory_gb),
        scheduler_config=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_model_len=args.max_model_len),
    )


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    add_speculative_arguments(p)
    p.add_argument("--transports", default="grpc,shm",
                   help="KV transports this worker accepts (grpc, shm, cuda_ipc)")
    p.add_argument("--advertise-host", default=None,
                   help="host prefill workers reach this worker at (default: --host)")
