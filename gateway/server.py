"""`pdserve gateway`: the public gRPC API and the OpenAI HTTP API in one process, on one uvloop
event loop, over one Backend.

Lifecycle:
    load the backend -> start gRPC + HTTP -> health SERVING -> print the addresses
    SIGTERM / Ctrl-C -> health NOT_SERVING (gRPC health, HTTP /health 503)
                     -> `--shutdown-delay` seconds still serving (load balancers notice)
                     -> stop accepting; in-flight streams get `--grace` seconds to finish,
                        then are cancelled (which aborts them in the backend)
                     -> backend.close() -> exit 0
A second signal skips the grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field

import uvicorn
import uvloop
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry

from engine_core.heap import freeze_startup_heap
from gateway import grpc_server
from gateway.api_servers import MetricsMirror, reuse_port_socket, shared_dir
from gateway.auth import APIKeys
from gateway.http_api import build_app
from gateway.metrics import GatewayMetrics, MeteredBackend
from gateway.openai.reasoning import resolve_parser
from gateway.tracing_backend import traced
from service_infra import tracing
from service_infra.backend import Backend, BackendUnavailable
from service_infra.tls import TLSConfig, tls_from_args

logger = logging.getLogger(__name__)

BackendFactory = Callable[[], Awaitable[Backend]]  # called inside the event loop
HEALTH_PROBE_INTERVAL_S = 2.0  # how often health asks the backend for its status
HEALTH_PROBE_TIMEOUT_S = 30.0  # a status slower than this is logged (health unchanged)
CANARY_FOLLOW_S = 0.25  # how soon health follows the canary's verdict


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0: pick a free port (printed)
    http_port: int = 8000  # 0: pick a free port (printed)
    grace_s: float = 10.0  # how long in-flight requests may finish on shutdown
    # NOT_SERVING -> still serving for this long (load balancers notice) -> stop accepting
    shutdown_delay_s: float = 0.0
    api_keys: APIKeys = field(default_factory=APIKeys)  # none: the public APIs are open
    tls: TLSConfig | None = None  # TLS on both public ports (service_infra/tls.py); None: plaintext
    max_num_choices: int = 64  # n x prompts of one OpenAI request; more is a 400
    reasoning_parser: str = "auto"  # gateway/openai/reasoning.py: auto, think or none
    # what clients may pass as `model`, the first in responses (empty: the model's own name)
    served_model_names: tuple[str, ...] = ()
    # one of several API servers on the same ports (gateway/api_servers.py); None: alone
    api_server_index: int | None = None

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("grace_s", "shutdown_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_choices < 1:
            raise ValueError(f"max_num_choices must be >= 1, got {self.max_num_choices}")
        resolve_parser(self.reasoning_parser, None)  # ValueError for an unknown one
        if any(not name for name in self.served_model_names) \
                or len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError(f"served model names must be distinct and not empty, got "
                             f"{list(self.served_model_names)}")


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(host=args.host, grpc_port=args.port, http_port=args.http_port,
                         grace_s=args.grace, shutdown_delay_s=args.shutdown_delay,
                         api_keys=APIKeys.from_sources(args.api_key, args.api_key_file),
                         tls=tls_from_args(args, is_public=True),
                         max_num_choices=args.max_num_choices,
                         reasoning_parser=args.reasoning_parser,
                         served_model_names=tuple(args.served_model_name),
                         api_server_index=args.api_server_index)


def chat_template_of(args: argparse.Namespace) -> str | None:
    """--chat-template's text (read and parsed now: a bad file fails at start), or None."""
    from engine_core.tokenizer import read_chat_template

    return read_chat_template(args.chat_template) if args.chat_template else None


def colocated_backend_factory(args: argparse.Namespace) -> BackendFactory:
    """Loads the engine now (before the event loop exists), wraps it inside the loop."""
    from engine_core.engine import LLMEngine
    from service_infra.colocated import ColocatedBackend
    from service_infra.worker_args import engine_configs

    chat_template = chat_template_of(args)
    engine = LLMEngine(**engine_configs(args))
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template

    async def create() -> Backend:
        return ColocatedBackend(engine, max_waiting=args.max_waiting)

    return create


def disaggregated_backend_factory(args: argparse.Namespace) -> BackendFactory:
    """The tokenizer and model limits come from the model file; the workers serve it. They
    are found at static addresses or, with --redis-url, in the Redis registry."""
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer
    from gateway.disagg.backend import DisaggregatedBackend
    from gateway.disagg.canary import CanaryConfig
    from gateway.disagg.discovery import StaticDiscovery
    from gateway.disagg.prefill_policy import PrefillPolicy

    policy = PrefillPolicy(args.prefill_policy, args.local_prefill_max_tokens)  # bad: fails now
    # with several API servers, one canary per gateway: the first's (gateway/api_servers.py)
    canary = CanaryConfig(args.canary_idle_s if not args.api_server_index else 0.0,
                          args.canary_timeout_s, args.canary_failures)
    redis_config = None
    if args.redis_url:
        from gateway.disagg.redis_discovery import RedisDiscovery
        from service_infra.redis_registry import RedisConfig

        redis_config = RedisConfig.from_args(args)  # bad flags fail here, before the loop
    source = resolve_model(args.model)
    if source.kind == "gguf":
        from engine_core.weights.gguf_file import GGUFMetadata

        config = GGUFMetadata(source.path).model_config()
    else:
        from engine_core.weights.safetensors_loader import load_hf_config

        config = load_hf_config(source.path)
    tokenizer = load_tokenizer(source, config.eos_token_ids, chat_template_of(args))
    max_len = min(args.max_model_len or config.max_position_embeddings,
                  config.max_position_embeddings)

    async def create() -> Backend:
        discovery = (StaticDiscovery(args.prefill, args.decode) if redis_config is None
                     else await RedisDiscovery.connect(redis_config))
        backend = DisaggregatedBackend(discovery, tokenizer,
                                       args.transport, args.lease_ttl, model_name=source.name,
                                       max_waiting=args.max_waiting,
                                       max_queue_wait_s=args.max_queue_wait,
                                       tls=tls_from_args(args, is_public=True),
                                       prefill_policy=policy, canary=canary)
        try:
            await backend.start(max_len, config.vocab_size)
        except BaseException:
            await backend.close()
            raise
        return traced(backend)  # request spans when --otlp-traces-endpoint is set

    return create


def run_gateway(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """`pdserve gateway` (flags: gateway/cli.py); argv: the command line after `pdserve`,
    which --api-servers N passes on to its N API servers."""
    if args.api_servers < 1:
        raise ValueError(f"--api-servers must be >= 1, got {args.api_servers}")
    if args.api_servers > 1:
        from gateway.api_servers import run_api_servers

        return run_api_servers(args, argv if argv is not None else sys.argv[1:])
    is_static = bool(args.prefill or args.decode)
    if args.colocated + is_static + bool(args.redis_url) != 1:
        raise ValueError("choose one backend: --colocated; --prefill ADDR... and --decode "
                         "ADDR... (disaggregated, static addresses); or --redis-url URL "
                         "(disaggregated, the workers register in Redis)")
    if is_static and not (args.prefill and args.decode):
        raise ValueError("the disaggregated mode needs --prefill and --decode addresses")
    config = gateway_config(args)
    tracing.setup("gateway", tracing.instance_id(args), args.otlp_traces_endpoint)
    factory = (colocated_backend_factory(args) if args.colocated
               else disaggregated_backend_factory(args))
    uvloop.run(serve(config, factory))
    return 0


class _HTTPServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the gateway owns SIGINT/SIGTERM and stops uvicorn itself


class _Health:
    """What gRPC health checking and HTTP /health report."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.is_serving = False

    async def set(self, is_serving: bool) -> None:
        self.is_serving = is_serving
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", grpc_server.SERVICE_NAME):
            await self.servicer.set(name, status)

    async def shut_down(self) -> None:
        self.is_serving = False
        await self.servicer.enter_graceful_shutdown()  # NOT_SERVING for good


async def serve(config: GatewayConfig, make_backend: BackendFactory,
                on_ready: Callable[[str, str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain and return."""
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal skips the grace period
        loop.add_signal_handler(sig, lambda: (force if stop.is_set() else stop).set())

    registry = CollectorRegistry()
    shared = shared_dir() if config.api_server_index is not None else None
    inner = await make_backend()
    if shared is not None:  # one canary per gateway: the first API server's verdict
        from gateway.disagg.canary import CanaryVerdict

        verdict = CanaryVerdict(shared)
        if config.api_server_index == 0:
            inner.canary_verdict_out = verdict
        else:
            inner.canary_verdict_in = verdict
    if config.served_model_names:  # the backend's model, under the names clients use
        first, *more = config.served_model_names
        inner.model = dataclasses.replace(inner.model, name=first, aliases=tuple(more))
    metrics = GatewayMetrics(registry, inner.model.name, inner.model.max_model_len)
    backend = MeteredBackend(inner, metrics, registry)
    backend.api_server_index = config.api_server_index
    mirror = None
    exposed = registry
    if shared is not None:  # /metrics: every API server's, from the multiprocess files
        from prometheus_client import multiprocess

        exposed = CollectorRegistry()
        multiprocess.MultiProcessCollector(exposed)
        mirror = MetricsMirror(backend.collector)
        mirror.start()
    health_ = _Health()
    grpc, grpc_port = grpc_server.create_server(backend, f"{config.host}:{config.grpc_port}",
                                                health_.servicer, metrics.reject,
                                                config.api_keys, config.tls,
                                                config.max_num_choices, config.reasoning_parser,
                                                reuse_port=shared is not None)
    await grpc.start()
    sockets = ([reuse_port_socket(config.host, config.http_port)]
               if shared is not None else None)
    http = _HTTPServer(uvicorn.Config(
        build_app(backend, lambda: health_.is_serving, exposed, metrics.reject,
                  config.api_keys, config.max_num_choices, config.reasoning_parser),
        host=config.host,
        port=config.http_port, lifespan="off", access_log=False, log_level="warning",
        http="httptools",
        timeout_graceful_shutdown=max(1, round(config.grace_s)), **_https(config.tls)))
    http_task = asyncio.create_task(http.serve(sockets=sockets))
    while not http.started:
        if http_task.done():  # could not bind: uvicorn gives up
            await grpc.stop(0)
            await backend.close()
            raise RuntimeError(f"the HTTP server could not start on "
                               f"{config.host}:{config.http_port}")
        await asyncio.sleep(0.02)
    http_port = http.servers[0].sockets[0].getsockname()[1]
    await health_.set(True)
    watchdog = asyncio.create_task(_watch_backend(backend, health_))
    freeze_startup_heap()  # the start's objects out of every later collection (heap.py)
    (on_ready or _print_ready)(f"{config.host}:{grpc_port}", f"{'https' if config.tls else 'http'}://{config.host}:{http_port}")

    await stop.wait()
    watchdog.cancel()
    await health_.shut_down()
    force_wait = asyncio.create_task(force.wait())
    if config.shutdown_delay_s > 0:
        logger.warning("shutting down: NOT_SERVING, accepting for %.1f s more",
                       config.shutdown_delay_s)
        await asyncio.wait({force_wait}, timeout=config.shutdown_delay_s)
    logger.warning("shutting down: draining for up to %.1f s", config.grace_s)
    http.should_exit = True
    drain = asyncio.gather(grpc.stop(config.grace_s), http_task, return_exceptions=True)
    await asyncio.wait({drain, force_wait}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():  # a second signal: cancel what is left now
        http.force_exit = True
        await grpc.stop(0)
        await drain
    force_wait.cancel()
    if mirror is not None:
        mirror.stop()
    await backend.close()


def _https(tls: TLSConfig | None) -> dict:
    """uvicorn's settings for HTTPS on the OpenAI port (client certificates when required)."""
    if tls is None:
        return {}
    out = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.ca_file:
        out["ssl_ca_certs"] = tls.ca_file
    if tls.require_client_cert:
        out["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return out


async def _watch_backend(backend: Backend, health_: _Health) -> None:
    """Health (readiness) follows the backend: NOT_SERVING while it cannot serve (engine
    failure, no worker left) or its canary fails (gateway/disagg/canary.py: the whole path, not just
    Status), SERVING again when both are well. The canary's verdict is followed within
    CANARY_FOLLOW_S; the backend's status (which waits for slow workers) every
    HEALTH_PROBE_INTERVAL_S."""
    inner = getattr(backend, "inner", backend)
    is_backend_ok, is_canary_ok = True, True

    async def update() -> None:
        is_ok = is_backend_ok and is_canary_ok
        if is_ok != health_.is_serving:
            logger.warning("backend %s", "available again" if is_ok else
                           "unavailable" if not is_backend_ok else "failing its canary")
            await health_.set(is_ok)

    async def follow_canary() -> None:
        nonlocal is_canary_ok
        while True:
            is_canary_ok = getattr(inner, "is_ready", True)
            await update()
            await asyncio.sleep(CANARY_FOLLOW_S)

    canary = asyncio.create_task(follow_canary())
    try:
        while True:
            try:
                await asyncio.wait_for(backend.status(), HEALTH_PROBE_TIMEOUT_S)
                is_backend_ok = True
            except BackendUnavailable:
                is_backend_ok = False
            except asyncio.TimeoutError:  # busy (a long prefill step on CPU) is not unavailable
                logger.warning("backend status took over %.0f s", HEALTH_PROBE_TIMEOUT_S)
            await update()
            await asyncio.sleep(HEALTH_PROBE_INTERVAL_S)
    finally:
        canary.cancel()


def _print_ready(grpc_addr: str, http_addr: str) -> None:
    print(f"pdserve gateway: gRPC {grpc_addr}  HTTP {http_addr}  (Ctrl-C stops)", flush=True)
