"""`pdserve` command line: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys

from gateway.cli import add_gateway_arguments, add_generate_arguments, run_gateway, run_generate
from service_infra.worker_args import (
    add_decode_activations_argument,
    add_decode_step_arguments,
    add_prefill_weights_argument,
    add_quantization_argument,
)


def _cmd_model(args: argparse.Namespace) -> int:
    from engine_core.model_files import PULLABLE, model_path, pull_model, resolve_model

    if args.model_cmd == "pull":
        path = pull_model(args.name, progress=True)
        print(f"{args.name}: {path}")
        return 0
    if args.model_cmd == "list":
        for name, spec in PULLABLE.items():
            path = model_path(name)
            state = str(path) if path.exists() else "not pulled"
            print(f"{name}\t{spec.filename}\t{state}")
        return 0
    source = resolve_model(args.model)
    if source.kind == "gguf":
        from engine_core.weights.gguf_file import GGUFMetadata

        config = GGUFMetadata(source.path).model_config()
    else:
        from engine_core.weights.safetensors_loader import load_hf_config

        config = load_hf_config(source.path)
    print(json.dumps({"kind": source.kind, "path": str(source.path), **config.__dict__},
                     indent=2, default=str))
    return 0


def _cmd_offline(args: argparse.Namespace) -> int:
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, decode_activations=args.decode_activations,
              quantization=args.quantization,
              enforce_eager=args.enforce_eager, prefill_weights=args.prefill_weights,
              async_scheduling=args.async_scheduling)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate(args.prompt, params)
    print(out[0].outputs[0].text)
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from pdserve.bench_engine import run

    return run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.bench.command import run

    return run(args)


def _cmd_up(args: argparse.Namespace) -> int:
    from pdserve.up import run

    return run(args)


def _cmd_prefill(args: argparse.Namespace) -> int:
    from prefill_service.server import run

    return run(args)


def _cmd_decode(args: argparse.Namespace) -> int:
    from decode_service.server import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("model", help="fetch or inspect models")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    pull = msub.add_parser("pull", help="download a pullable model (default: the default "
                           "model, SmolLM2-135M-Instruct GGUF)")
    pull.add_argument("name", nargs="?", default="SmolLM2-135M-Instruct",
                      help="SmolLM2-135M-Instruct or gemma3-270m")
    msub.add_parser("list", help="the pullable models and where they are once pulled")
    info = msub.add_parser("info", help="print a model's configuration")
    info.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    m.set_defaults(func=_cmd_model)

    o = sub.add_parser("offline", help="generate in this process (the colocated engine)")
    o.add_argument("prompt")
    o.add_argument("--model", default=None)
    o.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_decode_activations_argument(o)
    add_quantization_argument(o)
    add_prefill_weights_argument(o)
    add_decode_step_arguments(o)
    o.add_argument("--chat", action="store_true", help="apply the chat template")
    o.add_argument("--max-tokens", type=int, default=128)
    o.add_argument("--temperature", type=float, default=0.0)
    o.add_argument("--top-p", type=float, default=1.0)
    o.add_argument("--seed", type=int, default=None)
    o.set_defaults(func=_cmd_offline)

    from pdserve.up import add_up_arguments

    up = sub.add_parser("up", help="start gateway + prefill + decode workers locally")
    add_up_arguments(up)
    up.set_defaults(func=_cmd_up)

    gw = sub.add_parser("gateway", help="serve the public gRPC API and the OpenAI HTTP API")
    add_gateway_arguments(gw)
    gw.set_defaults(func=run_gateway)

    g = sub.add_parser("generate", help="generate through a running gateway (gRPC client)")
    add_generate_arguments(g)
    g.set_defaults(func=run_generate)

    from service_infra.worker_args import (
        add_decode_arguments,
        add_prefill_arguments,
        add_worker_arguments,
    )

    pf = sub.add_parser("prefill", help="run one prefill worker (gRPC)")
    add_worker_arguments(pf, default_port=50061)
    add_prefill_arguments(pf)
    pf.set_defaults(func=_cmd_prefill)

    dc = sub.add_parser("decode", help="run one decode worker (gRPC, receives KV)")
    add_worker_arguments(dc, default_port=50071)
    add_decode_arguments(dc)
    dc.set_defaults(func=_cmd_decode)

    b = sub.add_parser("bench-engine",
                       help="offline throughput: engine vs transformers generate, same run")
    b.add_argument("--model", default=None,
                   help="a pullable name, a GGUF file or a safetensors folder (default: the "
                        "default model)")
    b.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N, for the engine and transformers alike "
                        "(default: cuda where torch sees one, else cpu)")
    b.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on CUDA and where the CPU has native bf16, "
                        "else float32")
    add_decode_activations_argument(b)
    add_quantization_argument(b)
    add_prefill_weights_argument(b)
    add_decode_step_arguments(b)
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    b.add_argument("--hf-requests", type=int, default=2,
                   help="requests run one at a time through transformers generate")
    b.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each concurrency after an untimed one; the median is "
                        "reported, every run is kept in results.json")
    b.add_argument("--skip-hf", action="store_true")
    b.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16"],
                   help="transformers' dtype (default: the engine's); transformers 5 "
                        "computes a GGUF's packed weights in float32 and calls that fastest")
    b.add_argument("--sampling", nargs="+", default=["greedy"], metavar="SPEC",
                   help="sampling settings, each timed at every concurrency in every round: "
                        "'greedy' or SamplingParams fields as name=value,... (e.g. "
                        "temperature=1.0,top_p=0.95); ratios against greedy when it is there")
    b.add_argument("--out", default="bench_results/engine")
    b.set_defaults(func=_cmd_bench_engine)

    from pdserve.bench.args import add_bench_arguments

    bs = sub.add_parser("bench", help="load-test the gateway (gRPC or OpenAI HTTP) against a "
                        "naive transformers server and our colocated/disaggregated stacks")
    add_bench_arguments(bs)
    bs.set_defaults(func=_cmd_bench)
    return p


def apply_env_defaults(parser: argparse.ArgumentParser, command: str, environ=None) -> None:
    """Every option of `command` takes its default from PDSERVE_<OPTION> when set (e.g.
    PDSERVE_PORT=50061, PDSERVE_KV_CACHE_MEMORY_GB=4): how containers configure it. Flags
    given on the command line still win."""
    import os

    environ = os.environ if environ is None else environ
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                if command in action.choices:
                    parsers.append(action.choices[command])
                continue
            if not action.option_strings or action.dest == "help":
                continue
            value = environ.get(f"PDSERVE_{action.dest.upper()}")
            if value is None:
                continue
            if action.nargs in ("+", "*"):
                action.default = [action.type(v) if action.type else v for v in value.split()]
            elif isinstance(action, argparse._StoreTrueAction):
                action.default = value.lower() in ("1", "true", "yes")
            else:
                action.default = action.type(value) if action.type else value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    command = build_parser().parse_known_args(argv)[0].cmd  # env defaults for this one only
    apply_env_defaults(parser, command)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    # `kill -USR1 PID` prints every thread's stack to stderr: where a stuck process is stuck
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
