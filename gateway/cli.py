"""The flags of `pdserve gateway` and `pdserve generate`, kept free of heavy imports so that
the CLI starts fast; the commands import their modules when they run."""

from __future__ import annotations

import argparse

from kv_transfer import transports
from service_infra.tls import add_tls_arguments
from service_infra.tracing import add_tracing_argument
from service_infra.worker_args import (
    add_cache_decoded_blocks_argument,
    add_decode_activations_argument,
    add_decode_step_arguments,
    add_kv_offload_arguments,
    add_prefill_weights_argument,
    add_quantization_argument,
    add_redis_arguments,
    add_speculative_arguments,
)


def add_admission_arguments(p) -> None:
    """How the disaggregated gateway holds decode room (also `pdserve up`'s, passed on)."""
    p.add_argument("--lease-ttl", type=float, default=30.0,
                   help="seconds a decode worker holds reserved blocks without news: renewed "
                        "every third of it while the prompt is queued for prefill; the KV "
                        "transfer gets this long from its start and from each layer")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests that may wait at once for a decode worker with room (with "
                        "--colocated: for their first token); more get RESOURCE_EXHAUSTED "
                        "(HTTP 429)")
    p.add_argument("--max-queue-wait", type=float, default=300.0,
                   help="seconds a request may wait for a decode worker with room")
    p.add_argument("--max-num-choices", type=int, default=64,
                   help="choices one OpenAI request may ask for: n x prompts (a batch in "
                        "/v1/completions); more get HTTP 400 naming the bound")


def add_prefill_policy_arguments(p) -> None:
    """Where the disaggregated gateway prefills each prompt (also `pdserve up`'s, passed on;
    gateway/disagg/prefill_policy.py)."""
    p.add_argument("--prefill-policy", default="always-remote",
                   choices=["auto", "always-remote", "always-local"],
                   help="auto: per request, by the cost model (the decode worker prefills a "
                        "prompt whose uncached part is cheaper there than the hop to the "
                        "prefill pool); always-remote: the prefill pool; always-local: the "
                        "decode worker")
    p.add_argument("--local-prefill-max-tokens", type=int, default=1024,
                   help="with auto, a prompt whose uncached part on the decode worker is "
                        "longer is always prefilled remotely (>= 0)")


def add_canary_arguments(p) -> None:
    """The disaggregated gateway's canary (also `pdserve up`'s, passed on; gateway/disagg/canary.py)."""
    p.add_argument("--canary-idle-s", type=float, default=10.0,
                   help="after this many seconds without a successful request, send a "
                        "one-token request through every prefill->decode pair (Reserve, "
                        "Prefill, KV transfer, Decode); 0: off")
    p.add_argument("--canary-timeout-s", type=float, default=3.0,
                   help="a canary slower than this fails; when every pair's times out, "
                        "readiness turns NOT_SERVING at once")
    p.add_argument("--canary-failures", type=int, default=3,
                   help="rounds in a row with no pair succeeding that turn readiness "
                        "NOT_SERVING")


def add_chat_template_argument(p) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions that replaces the "
                        "model's own (a base model has none: chat requests get 400)")


def add_served_model_name_argument(p) -> None:
    """(also `pdserve up`'s, passed to the gateway)"""
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="the names clients may pass as `model` (vLLM's flag); the first is "
                        "what responses, /v1/models and the metrics' model_name say "
                        "(default: the model's own name)")


def add_reasoning_parser_argument(p) -> None:
    """(also `pdserve up`'s, passed to the gateway; gateway/openai/reasoning.py)"""
    p.add_argument("--reasoning-parser", default="auto",
                   choices=["auto", "think", "seed_oss", "harmony", "none"],
                   help="chat completions return the model's reasoning apart, as "
                        "reasoning_content: think, between <think> and </think> (Qwen3, "
                        "DeepSeek-R1, SmolLM3); seed_oss, between <seed:think> and "
                        "</seed:think> (Seed-OSS); harmony, GPT-OSS's analysis channel (its "
                        "final channel the content, its function calls tool_calls); auto: "
                        "harmony where the chat template writes <|channel|>, seed_oss where "
                        "it writes <seed:think>, think where it writes <think>; none: every "
                        "output whole, in content")


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `pdserve gateway`. The disaggregated mode finds its workers at static
    addresses (--prefill ADDR... --decode ADDR...) or in Redis (--redis-url)."""
    mode = p.add_argument_group("backend")
    mode.add_argument("--colocated", action="store_true",
                      help="run the engine in this process (prefill and decode together)")
    mode.add_argument("--prefill", nargs="+", default=[], metavar="HOST:PORT",
                      help="prefill workers (disaggregated mode)")
    mode.add_argument("--decode", nargs="+", default=[], metavar="HOST:PORT",
                      help="decode workers (disaggregated mode)")
    mode.add_argument("--transport", default="auto", choices=["auto", *transports.names()],
                      help="KV transport between the pools (auto: by locality)")
    add_admission_arguments(mode)
    add_prefill_policy_arguments(mode)
    add_canary_arguments(mode)
    mode.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    mode.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_chat_template_argument(mode)
    add_reasoning_parser_argument(mode)
    add_served_model_name_argument(mode)
    add_decode_activations_argument(mode)
    add_quantization_argument(mode)
    add_prefill_weights_argument(mode)
    mode.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    add_cache_decoded_blocks_argument(mode)
    add_kv_offload_arguments(mode)
    mode.add_argument("--max-num-seqs", type=int, default=64)
    mode.add_argument("--max-num-batched-tokens", type=int, default=2048)
    mode.add_argument("--max-model-len", type=int, default=None)
    add_speculative_arguments(p)  # for --colocated (decode workers take their own)
    add_decode_step_arguments(p)  # for --colocated (decode workers take their own)
    add_redis_arguments(p, is_worker=False)
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="0.0.0.0 in containers")
    net.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    net.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: any free port)")
    net.add_argument("--grace", type=float, default=10.0,
                     help="seconds in-flight requests may take to finish on shutdown")
    net.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="require this API key on the public APIs (repeatable; also the "
                          "PDSERVE_API_KEYS environment variable, comma-separated)")
    net.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="require one of the API keys in this file (one per line)")
    add_tls_arguments(p, is_public=True)
    add_tracing_argument(p)
    net.add_argument("--shutdown-delay", type=float, default=0.0,
                     help="seconds between reporting NOT_SERVING and closing the listeners")
    add_api_servers_argument(net)
    net.add_argument("--api-server-index", type=int, default=None, help=argparse.SUPPRESS)


def add_api_servers_argument(p) -> None:
    """(also `pdserve up`'s, passed to the gateway; gateway/api_servers.py)"""
    p.add_argument("--api-servers", type=int, default=1, metavar="N",
                   help="gateway processes sharing the HTTP and gRPC ports (SO_REUSEPORT), "
                        "each streaming its own clients' tokens; metrics and the canary are "
                        "shared (vLLM's --api-server-count); the disaggregated mode only")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--gateway", default="127.0.0.1:50051", help="the gateway's gRPC HOST:PORT")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    p.add_argument("--chat-template-kwargs", default="", metavar="JSON",
                   help="with --chat: more variables for the chat template, a JSON object "
                        "(e.g. '{\"enable_thinking\": false}' for Qwen3)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default="", help="model name (default: the served model)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="connect with TLS, verifying the gateway against this CA bundle")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="client certificate (gateways that require one)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    p.add_argument("--api-key", default=None,
                   help="the gateway's API key (default: the PDSERVE_API_KEY environment "
                        "variable)")
    p.add_argument("--timing", action="store_true",
                   help="print usage and the timing breakdown to stderr")


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.server import run_gateway as run

    return run(args)


def run_generate(args: argparse.Namespace) -> int:
    from gateway.client import run_generate as run

    return run(args)
