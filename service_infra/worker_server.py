"""The gRPC server shell shared by the prefill and decode workers.

    build servicers -> bind -> health SERVING -> announce (register in Redis, if asked)
    -> print "READY <role> <address>"
    SIGTERM / Ctrl-C -> withdraw the announcement (gateways stop sending new requests)
    -> health NOT_SERVING -> on_draining (the worker refuses new requests) -> until drained,
    the server still takes the calls of what the worker accepted before (a decode worker's
    reserved requests: their KV transfers and starts) -> stop accepting, in-flight calls get
    the rest of `grace_s` -> close the worker -> exit

Every worker server has gRPC health checking (the overall "" service and each named service)
and server reflection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_core.heap import freeze_startup_heap
from kv_transfer import GRPC_SERVER_OPTIONS
from service_infra import tracing
from service_infra.tls import TLSConfig, add_port

logger = logging.getLogger(__name__)


class Announcer(Protocol):
    """Tells gateways this worker serves (service_infra/worker_registration.py registers it in
    Redis)."""

    async def start(self, port: int) -> None:
        """Announce the worker at the bound port; raises if it cannot (the worker exits)."""
        ...

    async def stop(self) -> None:
        """Withdraw the announcement; bounded in time, never raises."""
        ...


async def serve_worker(
    role: str,
    address: str,
    add_servicers: Callable[[grpc.aio.Server], Sequence[str]],
    close: Callable[[], Awaitable[None]],
    grace_s: float = 5.0,
    on_bound: Callable[[int], Awaitable[None]] | None = None,
    announcer: Announcer | None = None,
    tls: TLSConfig | None = None,
    on_draining: Callable[[], None] | None = None,
    drained: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM. add_servicers registers the servicers and returns their
    full service names; on_bound(port) runs after binding, before SERVING; the announcer
    starts once SERVING and stops first thing on shutdown; on_draining() tells the worker to
    refuse new requests, and drained() returns when what it accepted before is done; the
    server takes calls until then (within `grace_s`). With `tls`, the port takes only
    mutual-TLS peers (a client certificate signed by the CA: service_infra/tls.py)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = grpc.aio.server(options=list(GRPC_SERVER_OPTIONS.items()),
                             interceptors=tracing.server_interceptors())
    names = list(add_servicers(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = add_port(server, address, tls)
    if port == 0:
        raise RuntimeError(f"{role}: could not bind {address}")
    if on_bound is not None:
        await on_bound(port)
    await server.start()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if announcer is not None:
        try:
            await announcer.start(port)
        except BaseException:
            await server.stop(0)
            await close()
            raise
    freeze_startup_heap()  # the start's objects out of every later collection (heap.py)
    host = address.rsplit(":", 1)[0]
    print(f"READY {role} {host}:{port}", flush=True)
    await stop.wait()
    logger.warning("%s shutting down: draining for up to %.1f s", role, grace_s)
    if announcer is not None:
        await announcer.stop()
    await health_servicer.enter_graceful_shutdown()
    if on_draining is not None:  # long-lived streams end as soon as their calls have
        on_draining()
    t_drain = loop.time()
    if drained is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drained(), grace_s)
    await server.stop(max(0.0, grace_s - (loop.time() - t_drain)))
    await close()
