"""A KVTransfer server on loopback, for the tests and benchmarks/bench_kv_transfer.py.

    LoopbackServer(servicer).start()    grpc.aio on its own event loop (uvloop when installed)
                                        in a background thread of this process
    ReceiverProcess(layout, ...)        a whole decode-side receiver (pool, lease table,
                                        server, same-host control socket) in a spawned child
                                        process, driven through a pipe: open a lease, claim
                                        it, read blocks back

The decode service does not use this module: it adds KVTransferServicer to its own server.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time

import grpc
import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer.grpc_options import GRPC_SERVER_OPTIONS
from kv_transfer.receiver.servicer import KVTransferServicer, add_kv_transfer_servicer


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopbackServer:
    """Serves one KVTransferServicer on 127.0.0.1:<free port> from a background thread."""

    def __init__(self, servicer: KVTransferServicer, host: str = "127.0.0.1") -> None:
        self.servicer = servicer
        self.loop = _new_loop()
        self.port = 0
        self._host = host
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="kv-loopback-server")

    @property
    def target(self) -> str:
        return f"{self._host}:{self.port}"

    def start(self) -> LoopbackServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server(options=list(GRPC_SERVER_OPTIONS.items()))
        add_kv_transfer_servicer(self._server, self.servicer)
        self.port = self._server.add_insecure_port(f"{self._host}:0")
        await self._server.start()

    def stop(self, grace_s: float | None = 0.5) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _receiver_main(conn, layout: KVLayout, num_blocks: int, use_shm: bool, device: str) -> None:
    """Child process: a decode-side receiver answering commands from the parent's pipe."""
    from kv_transfer.lease import LeaseTable
    from kv_transfer.receiver.control_server import LocalControlServer
    from kv_transfer.receiver.kv_receiver import KVReceiver
    from kv_transfer.transports.shm import SharedKVPool

    torch.set_num_threads(1)
    pool = SharedKVPool.create(layout, num_blocks) if use_shm else None
    kv_cache = pool.tensor if pool else layout.allocate(num_blocks, device)
    free = list(range(num_blocks))
    released: list[str] = []

    def on_release(lease, reason):
        released.append(f"{lease.state.name}: {reason}")
        free.extend(lease.block_ids)

    table = LeaseTable(on_release)
    receiver = KVReceiver(layout, kv_cache, table, shm_pool=pool)
    local = LocalControlServer(receiver).start()  # as the decode worker serves it
    server = LoopbackServer(KVTransferServicer(receiver, local.path)).start()
    conn.send(server.port)
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "open":  # (num_blocks, ttl_s) -> (lease_id, block ids)
                ids, free[:] = free[:args[0]], free[args[0]:]
                conn.send((table.open("bench", ids, args[1]).lease_id, ids))
            elif cmd == "claim":  # lease_id -> block ids, freed again at once
                ids = table.claim(args[0])
                free.extend(ids)
                conn.send(ids)
            elif cmd == "read":  # block ids -> kv_cache[:, ids] on the CPU
                conn.send(kv_cache[:, args[0]].cpu())
            elif cmd == "released":
                conn.send(list(released))
            elif cmd == "stop":
                break
    finally:
        server.stop()
        local.close()
        receiver.close()
        if pool is not None:
            pool.close()


class ReceiverProcess:
    """A decode-side receiver in a spawned child process; see _receiver_main's commands."""

    def __init__(self, layout: KVLayout, num_blocks: int, *, use_shm: bool,
                 device: str = "cpu") -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_receiver_main, daemon=True,
                                 args=(child, layout, num_blocks, use_shm, device))
        self._proc.start()
        deadline = time.monotonic() + 60
        while not self._conn.poll(0.1):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"receiver process failed to start "
                                   f"(exit code {self._proc.exitcode})")
        self.target = f"127.0.0.1:{self._conn.recv()}"

    def call(self, *cmd):
        self._conn.send(cmd)
        return self._conn.recv()

    def stop(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("stop",))
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
