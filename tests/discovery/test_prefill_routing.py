"""Prefill routing: the pure cost model (gateway/disagg/routing.py) with exact choices, then the
gateway's choice over a real Redis where one worker published a prompt's blocks."""

from __future__ import annotations

import asyncio
import zlib

import pytest

from engine_core.kv_cache.block_hash import hash_full_blocks
from gateway.disagg.backend import DisaggregatedBackend
from gateway.disagg.redis_discovery import RedisDiscovery
from gateway.disagg.routing import (
    QUEUE_WEIGHT_BLOCKS,
    offload_weight,
    pick_prefill,
    routing_overlap,
)
from service_infra.redis_registry import RedisConfig
from service_infra.worker_registration import WorkerInfo, WorkerRegistration

BLOCK_SIZE = 16


def test_without_prefix_information_the_shortest_queue_wins_ties_by_first_block():
    assert pick_prefill([2, 1, 1], None, tie_key=0) == 1
    assert pick_prefill([2, 1, 1], None, tie_key=1) == 2
    assert pick_prefill([2, 1, 1], None, tie_key=7) == 2
    assert pick_prefill([0], None, tie_key=5) == 0
    assert pick_prefill([3, 0], [0, 0], tie_key=0) == 1  # zero overlap everywhere: the same


def test_overlap_is_weighed_against_queue_depth():
    assert QUEUE_WEIGHT_BLOCKS == 8.0
    assert pick_prefill([0, 0], [10, 0], tie_key=1) == 0
    assert pick_prefill([1, 0], [10, 0], tie_key=1) == 0  # 10 - 8 = 2 > 0
    assert pick_prefill([2, 0], [10, 0], tie_key=0) == 1  # 10 - 16 < 0: the busier one loses
    assert pick_prefill([9, 0], [128, 0], tie_key=1) == 0  # 128 - 72 > 0: a long prefix
    assert pick_prefill([17, 0], [128, 0], tie_key=0) == 1  # 128 - 136 < 0: a longer queue
    # equal scores: the shorter queue, then the first block
    assert pick_prefill([1, 0], [8, 0], tie_key=0) == 1  # 8 - 8 = 0 = 0 - 0
    assert pick_prefill([1, 1, 0], [8, 8, 0], tie_key=1) == 2
    assert pick_prefill([1, 1], [5, 5], tie_key=3) == 1
    assert pick_prefill([3, 0], [10, 0], tie_key=0, queue_weight=0) == 0  # overlap only
    assert pick_prefill([0, 1, 0], [2, 9, 4], tie_key=0, queue_weight=1) == 1  # 8 > 4 > 2


def test_offload_tier_blocks_weigh_what_their_load_saves():
    assert offload_weight(1000.0, 0.0) == 1.0  # no load measured yet: a whole block
    assert offload_weight(0.0, 5000.0) == 1.0
    assert offload_weight(1000.0, 5000.0) == pytest.approx(0.8)  # loads 5x faster
    assert offload_weight(1000.0, 800.0) == 0.0  # a tier slower than compute saves nothing
    assert routing_overlap(3, 3, 0.5) == 3
    assert routing_overlap(3, 13, 0.8) == pytest.approx(11.0)
    assert routing_overlap(0, 10, 0.0) == 0
    # 10 pool blocks beat 12 tier blocks at 0.8 each (9.6); at 0.9 (10.8) the tiers win
    assert pick_prefill([0, 0], [10, routing_overlap(0, 12, 0.8)], tie_key=1) == 0
    assert pick_prefill([0, 0], [10, routing_overlap(0, 12, 0.9)], tie_key=0) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="no prefill worker"):
        pick_prefill([], None, 0)
    with pytest.raises(ValueError, match="one overlap per worker"):
        pick_prefill([0, 0], [1], 0)
    with pytest.raises(ValueError, match="queue_weight"):
        pick_prefill([0], [1], 0, queue_weight=-1)


async def registered_prefill_workers(config: RedisConfig, n: int, first_port: int
                                     ) -> tuple[list[WorkerRegistration], DisaggregatedBackend]:
    """n prefill workers registered in Redis (prefill-0, ...; with offload tiers) and a
    gateway's backend that discovered them."""
    info = WorkerInfo("prefill", "m", "f", BLOCK_SIZE, 100, 8, num_offload_blocks=100)
    regs = [WorkerRegistration(config, info, "127.0.0.1", f"prefill-{i}") for i in range(n)]
    for port, reg in enumerate(regs, start=first_port):
        await reg.start(port)
    backend = DisaggregatedBackend(await RedisDiscovery.connect(config), tokenizer=None)
    backend.pools.block_size = BLOCK_SIZE
    await backend.pools.discover()
    return regs, backend


def test_the_gateway_routes_to_the_worker_that_published_the_prefix(redis_server):
    prompt = list(range(1000, 1000 + 5 * BLOCK_SIZE + 3))  # 5 full blocks
    other = list(range(7, 7 + 5 * BLOCK_SIZE))
    config = RedisConfig(redis_server.url)

    async def scenario() -> None:
        regs, backend = await registered_prefill_workers(config, 2, first_port=7001)
        discovery = backend.pools.discovery
        workers = {w.worker_id: w for w in backend.prefill}
        for w in workers.values():
            w.is_healthy = True
        # a prompt nobody published: the first block decides, as without Redis
        key = zlib.crc32(bytes(str(other[:16]), "ascii"))
        expected = backend.prefill[pick_prefill([0, 0], None, key)]
        assert await backend.handoff.pick_prefill(other) is expected
        # the worker the first block does not pick holds the prompt: it gets it
        key = zlib.crc32(bytes(str(prompt[:16]), "ascii"))
        holder = backend.prefill[1 - pick_prefill([0, 0], None, key)]
        regs[int(holder.worker_id[-1])].publish_prefix(hash_full_blocks(prompt, BLOCK_SIZE))
        await asyncio.sleep(0.2)
        assert await discovery.prefix_overlap(list(workers), hash_full_blocks(
            prompt, BLOCK_SIZE)) == {holder.worker_id: 5, (set(workers) - {
                holder.worker_id}).pop(): 0}
        assert await backend.handoff.pick_prefill(prompt) is holder
        # the other worker's offload tiers hold the prompt: (pool, pool or tiers) per worker,
        # and with no load measured a tier block counts whole, so 5 each: ties by queue, key
        other_worker = next(w for w in backend.prefill if w is not holder)
        regs[int(other_worker.worker_id[-1])].publish_offloaded(
            hash_full_blocks(prompt, BLOCK_SIZE))
        await asyncio.sleep(0.2)
        assert await discovery.offload_overlap(list(workers), hash_full_blocks(
            prompt, BLOCK_SIZE)) == {holder.worker_id: (5, 5), other_worker.worker_id: (0, 5)}
        assert await backend.handoff.pick_prefill(prompt) is other_worker  # the key's pick
        # its measured load is 5x its compute: 5 * 0.8 = 4 < 5 held in a pool
        from protos.pdserve.internal import workers_pb2 as wpb
        other_worker.status = wpb.WorkerStatus(prefill_tokens_per_s=1000.0,
                                               offload_load_tokens_per_s=5000.0)
        assert await backend.handoff.pick_prefill(prompt) is holder
        # a stop deletes the prefix set, not the offload set: a restart keeps its tiers
        info = WorkerInfo("prefill", "m", "f", BLOCK_SIZE, 100, 8, num_offload_blocks=3)
        gone = WorkerRegistration(config, info, "127.0.0.1", "prefill-9")
        await gone.start(7009)
        gone.publish_prefix(hash_full_blocks(prompt, BLOCK_SIZE))
        gone.publish_offloaded(hash_full_blocks(prompt, BLOCK_SIZE))
        await asyncio.sleep(0.2)
        await gone.stop()
        client = await config.connect()
        assert await client.zcard(config.offload_key("prefill-9")) == 3  # its cap: the newest
        assert not await client.exists(config.prefix_key("prefill-9"))
        await client.aclose()
        holder.in_flight = 1  # 5 - 8 < 0: the idle worker wins despite the overlap
        assert await backend.handoff.pick_prefill(prompt) is not holder
        holder.in_flight = 0
        # Redis gone: routing by queue depth (no error, one warning)
        redis_server.proc.terminate()
        redis_server.proc.wait()
        idle = next(w for w in backend.prefill if w is not holder)
        idle.in_flight = 1
        assert await backend.handoff.pick_prefill(prompt) is holder
        holder.in_flight = 2
        assert await backend.handoff.pick_prefill(prompt) is idle
        assert [w.worker_id for w in backend.prefill] == ["prefill-0", "prefill-1"]
        await backend.pools.discover()  # discovery keeps what it last saw
        assert [w.worker_id for w in backend.prefill] == ["prefill-0", "prefill-1"]
        for reg in regs:
            await reg.stop()  # bounded, logs that the key will expire
        await backend.close()

    asyncio.run(scenario())


def test_without_redis_prefill_workers_status_routes_and_prices_a_remote_prefill():
    """Static discovery: prefill workers list their prefix blocks in Status, as decode workers
    do. The prompt goes to the one that holds it, and the remote side of the prefill cost
    counts only what that worker lacks: a chat whose history the decode worker holds (its
    replies' KV, computed there) is dearer to prefill remotely than its local rest."""
    from engine_core.sampling_params import SamplingParams
    from gateway.disagg.discovery import StaticDiscovery
    from protos.pdserve.internal import workers_pb2 as wpb
    from service_infra.backend import GenerateInput

    history = list(range(1000, 1000 + 5 * BLOCK_SIZE + 3))  # the first turn's prompt
    prompt = history + list(range(50, 50 + 3 * BLOCK_SIZE))  # its reply and a follow-up

    async def scenario() -> None:
        backend = DisaggregatedBackend(StaticDiscovery(["p0:1", "p1:1"], ["d0:1"]),
                                       tokenizer=None)
        backend.pools.block_size = BLOCK_SIZE
        await backend.pools.discover()
        (decode,) = backend.decode
        for w in backend.prefill + backend.decode:
            w.is_healthy = True
            w.status = wpb.WorkerStatus(prefill_tokens_per_s=1000.0, kv_bytes_per_token=100,
                                        kv_transfer_bytes_per_s=1e9)
        key = zlib.crc32(bytes(str(prompt[:16]), "ascii"))
        holder = backend.prefill[1 - pick_prefill([0, 0], None, key)]
        inp = GenerateInput("r", prompt, SamplingParams())
        # the decode worker holds all 8 full blocks; nobody lists the history yet
        res = wpb.ReserveResponse(num_cached_tokens=8 * BLOCK_SIZE)
        costs = backend.placement.costs(inp, decode, res, await backend.placement.prefix_held(prompt))
        assert (costs.num_local_tokens, costs.num_remote_tokens) == (3, len(prompt))
        holder.prefix_hashes = frozenset(hash_full_blocks(history, BLOCK_SIZE))
        assert await backend.handoff.pick_prefill(prompt) is holder
        costs = backend.placement.costs(inp, decode, res, await backend.placement.prefix_held(prompt))
        assert (costs.num_local_tokens, costs.num_remote_tokens) == (3, len(prompt) - 80)
        decision, _ = await backend.placement.place(inp, decode, res)
        assert decision.as_dict()["num_remote_tokens"] == len(prompt) - 80
        assert decision.where == "local" and decision.local_cost_s < decision.remote_cost_s
        # a prompt the prefill worker holds whole still computes its last token there
        holder.prefix_hashes = frozenset(hash_full_blocks(prompt, BLOCK_SIZE))
        whole = GenerateInput("w", prompt[:8 * BLOCK_SIZE], SamplingParams())
        held = await backend.placement.prefix_held(whole.prompt_token_ids)
        assert backend.placement.costs(whole, decode, res, held).num_remote_tokens == 1
        # the other prefill worker's offload tiers hold the history (evicted from its pool):
        # it loads those 5 blocks, computes the rest; routing counts them whole while its
        # load speed is unmeasured: 5 against the 1 block left in the holder's pool
        holder.prefix_hashes = frozenset(hash_full_blocks(history, BLOCK_SIZE)[:1])
        loader = next(w for w in backend.prefill if w is not holder)
        loader.offload_hashes = frozenset(hash_full_blocks(history, BLOCK_SIZE))
        assert await backend.handoff.pick_prefill(prompt) is loader
        costs = backend.placement.costs(inp, decode, res, await backend.placement.prefix_held(prompt))
        assert (costs.num_remote_tokens, costs.num_remote_load_tokens) == (len(prompt) - 80, 80)
        assert costs.remote_load_tokens_per_s == 0.0
        loader.status = wpb.WorkerStatus(prefill_tokens_per_s=1000.0, kv_bytes_per_token=100,
                                         kv_transfer_bytes_per_s=1e9,
                                         offload_load_tokens_per_s=20_000.0)
        costs = backend.placement.costs(inp, decode, res, await backend.placement.prefix_held(prompt))
        assert costs.remote_load_tokens_per_s == 20_000.0
        # a tier that loads slower than the worker computes saves nothing: 0 against 1
        loader.status.offload_load_tokens_per_s = 500.0
        assert await backend.handoff.pick_prefill(prompt) is holder
        await backend.close()

    asyncio.run(scenario())


def test_a_shared_tier_counts_for_every_worker_that_reaches_it(redis_server):
    """Three prefill workers: 0 and 1 list the same Redis tier in their Status, 2 a disk of
    its own. What 0 stored (its offload set) is held in the tiers of 0 and of 1, not of 2,
    in Redis and, without it, from Status; with 0 busy, the returning prompt goes to 1."""
    from gateway.disagg.discovery import StaticDiscovery
    from protos.pdserve.internal import workers_pb2 as wpb

    prompt = list(range(1000, 1000 + 5 * BLOCK_SIZE + 3))
    hashes = hash_full_blocks(prompt, BLOCK_SIZE)
    tiers = [["redis:shared", "disk:a"], ["redis:shared", "disk:b"], ["disk:c"]]
    config = RedisConfig(redis_server.url)

    def set_status(workers):
        for w in workers:
            w.is_healthy = True
            w.status = wpb.WorkerStatus(offload_tier_ids=tiers[int(w.worker_id[-1])])

    async def check(backend, by_id):
        held = await backend.pools.prefill_overlaps(prompt, backend.prefill)
        assert {w.worker_id: h for w, h in zip(backend.prefill, held, strict=True)} == {
            by_id[0]: (0, 5), by_id[1]: (0, 5), by_id[2]: (0, 0)}
        busy = next(w for w in backend.prefill if w.worker_id == by_id[0])
        busy.in_flight = 2  # 5 - 16 < 0
        assert (await backend.handoff.pick_prefill(prompt)).worker_id == by_id[1]
        busy.in_flight = 0

    async def with_redis() -> None:
        regs, backend = await registered_prefill_workers(config, 3, first_port=7101)
        set_status(backend.prefill)
        regs[0].publish_offloaded(hashes)
        await asyncio.sleep(0.2)
        await check(backend, [f"prefill-{i}" for i in range(3)])
        # without the Status identities nobody shares: only 0 holds them
        for w in backend.prefill:
            w.status = wpb.WorkerStatus()
        held = await backend.pools.prefill_overlaps(prompt, backend.prefill)
        assert sorted(held) == [(0, 0), (0, 0), (0, 5)]
        for reg in regs:
            await reg.stop()
        await backend.close()

    async def from_status() -> None:
        backend = DisaggregatedBackend(StaticDiscovery(["p0:1", "p1:1", "p2:1"], ["d0:1"]),
                                       tokenizer=None)
        backend.pools.block_size = BLOCK_SIZE
        await backend.pools.discover()
        for i, w in enumerate(backend.prefill):
            w.worker_id = f"p{i}"
        set_status(backend.prefill)
        backend.prefill[0].offload_hashes = frozenset(hashes)
        await check(backend, ["p0", "p1", "p2"])
        await backend.close()

    asyncio.run(with_redis())
    asyncio.run(from_status())
