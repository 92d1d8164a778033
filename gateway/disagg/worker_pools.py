"""The worker pools the disaggregated gateway routes over, as discovery and Status say.

    discovery.workers()   -> joins (connect), leaves (close when idle), restarts at the same
                             address (new worker id or epoch: a new channel), workers with
                             another KV layout (ignored, warned about once)
    Status every REFRESH_S -> health, free blocks, queue depths for routing; a worker is
                             unhealthy when unreachable, or after STALL_STATUS_TIMEOUTS slow
                             answers in a row (one slow answer is a busy worker)
    prefix_overlaps()      -> the prompt blocks each worker caches (Redis, else Status)
    prefill_overlaps()     -> the same for prefill workers, and what their offload tiers add
                             (a tier shared by several: what any of them stored there)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from engine_core.kv_cache.block_hash import hash_full_blocks
from gateway.disagg.decode_stream import DecodeStream
from gateway.disagg.discovery import Discovery, WorkerAddress
from gateway.disagg.pair_health import PairHealth
from gateway.disagg.routing import MAX_ROUTING_BLOCKS, leading_overlap
from kv_transfer import GRPC_CHANNEL_OPTIONS
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra import tracing
from service_infra.tls import TLSConfig
from service_infra.tls import channel as tls_channel

logger = logging.getLogger(__name__)
STATUS_TIMEOUT_S = 5.0
STALL_STATUS_TIMEOUTS = 3  # Status timeouts in a row that make a worker count as stalled
REFRESH_S = 1.0


@dataclass
class Worker:
    address: str
    stub: Any
    channel: grpc.aio.Channel
    in_flight: int = 0  # requests this gateway has on the worker now
    num_tokens_in_flight: int = 0  # prompt tokens this gateway has queued on a prefill worker
    num_local_tokens_in_flight: int = 0  # decode workers: local prefills not yet at a token
    status: pb.WorkerStatus | None = None
    is_healthy: bool = False
    worker_id: str = ""  # as discovery names it ("" for static addresses)
    epoch: int = 0  # discovery's restart epoch: another one at this address is a new process
    num_slow_status: int = 0  # Status calls in a row that timed out
    prefix_hashes: frozenset[int] = frozenset()  # its Status: the prefix blocks it holds
    offload_hashes: frozenset[int] = frozenset()  # its Status: blocks in its offload tiers
    outputs: DecodeStream | None = None  # decode workers: this gateway's output stream

    def close(self) -> None:
        if self.outputs is not None:
            self.outputs.close()


def tier_peers(workers: Sequence[Worker]) -> list[list[int]]:
    """For each worker, the others (indices) with an offload tier of the same identity in
    their Status (a Redis server, a directory they share): what those stored there, it
    loads."""
    ids = [frozenset(w.status.offload_tier_ids) if w.status is not None else frozenset()
           for w in workers]
    return [[j for j, other in enumerate(ids) if j != i and mine & other]
            for i, mine in enumerate(ids)]


class WorkerPools:
    """The prefill and decode workers known now (`prefill`, `decode`), kept up to date."""

    def __init__(self, discovery: Discovery, tls: TLSConfig | None = None) -> None:
        self.discovery = discovery
        self.tls = tls  # mutual TLS to the workers (our certificate is the client's)
        self.prefill: list[Worker] = []  # as discovery last answered
        self.decode: list[Worker] = []
        self.layout_fingerprint = ""  # the workers' (from their status at start)
        self.block_size = 16  # the workers' (from their status at start)
        self.pair_health = PairHealth()  # (prefill, decode) pairs whose handoffs failed
        self._refused: set[tuple[str, int]] = set()  # (address, epoch) of another layout
        self._discovering = asyncio.Lock()
        self._refresher: asyncio.Task | None = None

    async def discover(self) -> None:
        """Follow discovery: connect to workers that joined, drop those that left, reconnect
        to those that restarted (same address, new worker id or epoch)."""
        async with self._discovering:  # the refresh loop and status() both call this
            found = await self.discovery.workers()
            for role, stub_cls in (("prefill", pb_grpc.PrefillStub),
                                   ("decode", pb_grpc.DecodeStub)):
                wanted = [w for w in found if w.role == role and self._fits(w)]
                setattr(self, role, await self._follow(role, getattr(self, role), wanted,
                                                       stub_cls))

    async def _follow(self, role: str, workers: list[Worker], wanted: list[WorkerAddress],
                      stub_cls) -> list[Worker]:
        """One pool after discovery's answer: kept workers are the same objects."""
        current = {w.address: w for w in workers}
        kept = []
        for found in wanted:
            worker = current.pop(found.address, None)
            if worker is not None and (worker.worker_id, worker.epoch) != (found.worker_id,
                                                                           found.epoch):
                logger.info("%s worker restarted: %s (epoch %d -> %d)", role, found.address,
                            worker.epoch, found.epoch)
                await self._forget(worker)
                worker = None
            if worker is None:
                logger.info("%s worker joined: %s", role, found.address)
                channel = tls_channel(found.address, self.tls, GRPC_CHANNEL_OPTIONS.items(),
                                      is_aio=True, interceptors=tracing.client_interceptors())
                stub = stub_cls(channel)
                worker = Worker(found.address, stub, channel, worker_id=found.worker_id,
                                epoch=found.epoch,
                                outputs=DecodeStream(stub) if role == "decode" else None)
            kept.append(worker)
        for gone in current.values():
            logger.info("%s worker left: %s", role, gone.address)
            await self._forget(gone)
        return kept

    def _fits(self, w: WorkerAddress) -> bool:
        """False for a worker registered with another KV layout than the pools started with
        (its handoffs would be refused); warned about once per process."""
        if not (self.layout_fingerprint and w.layout_fingerprint) or (
                w.layout_fingerprint == self.layout_fingerprint):
            return True
        if (w.address, w.epoch) not in self._refused:
            self._refused.add((w.address, w.epoch))
            logger.warning("ignoring %s worker %s: KV layout %s, the pools use %s", w.role,
                           w.address, w.layout_fingerprint, self.layout_fingerprint)
        return False

    @staticmethod
    async def _forget(worker: Worker) -> None:
        if worker.in_flight == 0:  # else its in-flight requests still use the channel
            worker.close()
            await worker.channel.close()

    def start_refreshing(self) -> None:
        self._refresher = asyncio.create_task(self._refresh_loop())

    async def prefix_overlaps(self, prompt: list[int], workers: Sequence[Worker]
                              ) -> list[int] | None:
        """How many of the prompt's leading full blocks (up to MAX_ROUTING_BLOCKS) each worker
        caches: from Redis when discovery has it (one round trip, bounded; None when it
        fails), else from the workers' Status."""
        hashes = hash_full_blocks(prompt[:MAX_ROUTING_BLOCKS * self.block_size], self.block_size)
        if not hashes:
            return [0] * len(workers)
        query = getattr(self.discovery, "prefix_overlap", None)
        if query is None:
            return [leading_overlap(hashes, w.prefix_hashes) for w in workers]
        held = await query([w.worker_id for w in workers], hashes)
        return None if held is None else [held.get(w.worker_id, 0) for w in workers]

    async def prefill_overlaps(self, prompt: list[int], workers: Sequence[Worker]
                               ) -> list[tuple[int, int]] | None:
        """Per prefill worker: (leading prompt blocks in its pool, leading blocks in its pool
        or its offload tiers), as prefix_overlaps finds them (None when Redis fails). A tier
        it shares with others (the same identity in their Status) holds what they stored
        there too."""
        hashes = hash_full_blocks(prompt[:MAX_ROUTING_BLOCKS * self.block_size], self.block_size)
        if not hashes:
            return [(0, 0)] * len(workers)
        peers = tier_peers(workers)
        query = getattr(self.discovery, "offload_overlap", None)
        if query is None:
            return [(leading_overlap(hashes, w.prefix_hashes),
                     leading_overlap(hashes, w.prefix_hashes, w.offload_hashes,
                                     *(workers[j].offload_hashes for j in peers[i])))
                    for i, w in enumerate(workers)]
        ids = [w.worker_id for w in workers]
        held = await query(ids, hashes, {ids[i]: [ids[j] for j in js]
                                         for i, js in enumerate(peers) if js})
        return None if held is None else [held.get(w.worker_id, (0, 0)) for w in workers]

    async def _refresh_loop(self) -> None:
        """Routing reads free blocks and health from here: refreshed every REFRESH_S."""
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.refresh()

    async def refresh(self) -> None:
        await self.discover()

        async def one(w: Worker) -> None:
            try:
                w.status = await w.stub.Status(pb.StatusRequest(), timeout=STATUS_TIMEOUT_S)
                w.prefix_hashes = frozenset(w.status.prefix_block_hashes)
                w.offload_hashes = frozenset(w.status.offload_block_hashes)
                if not w.is_healthy:
                    logger.info("worker %s answers Status: healthy", w.address)
                w.is_healthy, w.num_slow_status = True, 0
            except grpc.aio.AioRpcError as e:
                # Status runs between two engine steps: one slow answer is a busy worker (a
                # long prefill step), not a dead one; STALL_STATUS_TIMEOUTS in a row is a
                # stalled one. Unreachable is unhealthy at once.
                w.num_slow_status += e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if (e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or w.status is None
                        or w.num_slow_status >= STALL_STATUS_TIMEOUTS):
                    if w.is_healthy:
                        logger.warning("worker %s is unhealthy: Status %s (%d slow in a row): "
                                       "%s", w.address, e.code().name, w.num_slow_status,
                                       e.details())
                    w.is_healthy = False

        await asyncio.gather(*(one(w) for w in self.prefill + self.decode))

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self.discovery.close()
        for w in self.prefill + self.decode:
            w.close()
            await w.channel.close()
