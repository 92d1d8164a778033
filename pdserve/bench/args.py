"""The flags of `pdserve bench`, kept free of heavy imports so that the CLI starts fast."""

from __future__ import annotations

import argparse

from kv_transfer import transports

# servers.py starts them; conditional and always-remote are `pdserve up` with that
# --prefill-policy (auto and always-remote), disagg with the stack's default policy
BACKENDS = ("naive", "colocated", "disagg", "conditional", "always-remote")
DEFAULT_BACKENDS = ("naive", "colocated", "disagg")
# the workloads where the prefill policy is what is compared (issue 18)
POLICY_BACKENDS = ("conditional", "always-remote", "colocated")
WORKLOADS = ("fixed", "random", "prompts", "shared-prefix", "mixed", "code-edit",
             "multi-turn", "structured", "host-overhead")
APIS = ("chat", "completions")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("systems under test")
    what.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                      help="started by the harness one after the other, same model, same run "
                           f"(default: {' '.join(DEFAULT_BACKENDS)}; for the mixed and "
                           f"multi-turn workloads: {' '.join(POLICY_BACKENDS)})")
    what.add_argument("--gateway", default=None, metavar="HOST:PORT",
                      help="bench an already-running gateway over gRPC instead")
    what.add_argument("--base-url", default=None, metavar="URL",
                      help="bench an already-running OpenAI server instead (http://HOST:PORT)")
    what.add_argument("--label", default=None, help="the name of that running server")
    what.add_argument("--protocol", choices=["grpc", "http"], default="http",
                      help="how to reach the gateways (the naive server speaks HTTP only)")
    what.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    what.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    what.add_argument("--stack-args", default="", metavar="ARGS",
                      help="extra flags for both of our stacks, one string, e.g. "
                           "\"--max-num-seqs 32\" (shlex-split; one flag alone needs '=': "
                           "--stack-args=--flag)")
    what.add_argument("--colocated-args", default="", metavar="ARGS",
                      help="extra flags for `pdserve gateway --colocated` only")
    what.add_argument("--disagg-args", default="", metavar="ARGS",
                      help="extra flags for `pdserve up` only")
    what.add_argument("--naive-args", default="", metavar="ARGS",
                      help="extra flags for the naive server, e.g. \"--threads 1\"")
    what.add_argument("--prefill", type=int, default=1, help="disagg: prefill workers")
    what.add_argument("--decode", type=int, default=1, help="disagg: decode workers")
    what.add_argument("--transport", default="auto", choices=["auto", *transports.names()],
                      help="disagg: KV transport")

    load = p.add_argument_group("workload")
    load.add_argument("--workload", choices=WORKLOADS, default="random")
    load.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    load.add_argument("--output-len", type=int, default=None,
                      help="tokens to generate (default: 64; prompts: 128; multi-turn: 32 per "
                           "turn; code-edit: the code's length + 48)")
    load.add_argument("--api", choices=APIS, default="chat",
                      help="chat: every prompt goes out as a chat request (over HTTP "
                           "/v1/chat/completions), as clients send them; completions: plain "
                           "prompts as /v1/completions text (gRPC: token ids)")
    load.add_argument("--range-ratio", type=float, default=0.5,
                      help="random: lengths uniform in len * [1 - r, 1 + r]")
    load.add_argument("--prefix-len", type=int, default=256,
                      help="shared-prefix: tokens every prompt shares")
    load.add_argument("--num-long", type=int, default=4, help="mixed: long prompts")
    load.add_argument("--long-input-len", type=int, nargs=2, default=[1024, 2048],
                      metavar=("MIN", "MAX"), help="mixed: long prompts' length range")
    load.add_argument("--long-output-len", type=int, default=16)
    load.add_argument("--history-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                      help="multi-turn: each chat opens with a document of MIN-MAX tokens "
                           "(long histories, as agents and RAG send; default: a short opener)")
    load.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                      help="start every backend twice, without KV offload tiers and with the "
                           "disk tier in DIR/<backend> (emptied first), and report both "
                           "(<backend> and <backend>+disk): the tier's effect on returning "
                           "turns, with the hit rate where the server reports it")
    load.add_argument("--long-rate", type=float, default=0.5,
                      help="mixed: long prompts per second (Poisson)")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                      help="generate exactly the output length (default: yes, except for "
                           "prompts, code-edit and multi-turn)")
    load.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature of every request (0: greedy; default: left "
                           "out, as most clients do, which means 1.0)")
    load.add_argument("--top-p", type=float, default=None,
                      help="nucleus sampling: every request's top_p in (0, 1] (default: unset)")
    load.add_argument("--top-k", type=int, default=None,
                      help="every request's top_k (-1 or 0: off; default: unset)")
    load.add_argument("--repetition-penalty", type=float, default=None,
                      help="every request's repetition_penalty (> 0; 1: off; default: unset)")
    load.add_argument("--vs-greedy", action="store_true",
                      help="run every point twice on the same server, greedy then with the "
                           "sampling above, and report their ratio")
    load.add_argument("--curve", default=None, metavar="PNG",
                      help="draw output tokens/s against concurrency, greedy and sampled side "
                           "by side, to this PNG (implies --vs-greedy; default concurrency: "
                           "1 8 32 64)")
    load.add_argument("--num-prompts", type=int, default=32,
                      help="requests per point (multi-turn: conversations of 4-8 turns)")
    load.add_argument("--concurrency", type=int, nargs="+", default=None,
                      help="a sweep: one point per value (requests in flight at most; "
                           "multi-turn: conversations in flight; default: 1 8 32, with "
                           "--curve 1 8 32 64)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second (inf: all at once)")
    load.add_argument("--max-duration", type=float, default=300.0,
                      help="seconds per point; what runs then is cancelled (incomplete)")
    load.add_argument("--naive-max-requests", type=int, default=8,
                      help="requests per point for the naive server (one at a time, slow)")
    load.add_argument("--naive-max-duration", type=float, default=120.0,
                      help="seconds per point for the naive server")
    load.add_argument("--seed", type=int, default=0)

    host = p.add_argument_group("host-overhead workload (pdserve/bench/host_overhead.py)")
    host.add_argument("--baseline-repo", default=None, metavar="DIR",
                      help="host-overhead: also bench this checkout of another commit (its "
                           "code, this Python), the same way in the same run")
    host.add_argument("--repeats", type=int, default=1,
                      help="host-overhead: rounds, the stacks alternating; medians reported")

    out = p.add_argument_group("report")
    out.add_argument("--ttft-slo-ms", type=float, default=2000.0,
                     help="goodput: TTFT limit (<= 0: none)")
    out.add_argument("--tpot-slo-ms", type=float, default=200.0,
                     help="goodput: TPOT limit (<= 0: none)")
    out.add_argument("--out", default="bench_results/serve",
                     help="folder for the JSON files, the plots and the servers' logs")
