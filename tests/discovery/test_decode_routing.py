"""Decode routing: the order decode workers are asked to reserve a prompt (gateway/disagg/routing.py's
rank_decode, with exact orders), the leading overlap of chain hashes, the record of prefix
blocks a decode worker publishes (service_infra/prefix_record.py), and the gateway's order
over a real Redis where one decode worker published a prompt's blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine_core.kv_cache.block_hash import hash_full_blocks
from gateway.disagg.backend import DisaggregatedBackend
from gateway.disagg.redis_discovery import RedisDiscovery
from gateway.disagg.routing import DECODE_QUEUE_WEIGHT_BLOCKS, leading_overlap, rank_decode
from service_infra.prefix_record import PrefixRecord
from service_infra.redis_registry import RedisConfig
from service_infra.worker_registration import WorkerInfo, WorkerRegistration


def test_without_prefix_information_fewest_in_flight_then_most_free_blocks():
    assert rank_decode([1, 0, 0], [50, 10, 30], None) == [2, 1, 0]
    assert rank_decode([0, 0], [10, 10], [0, 0]) == [0, 1]  # all equal: list order


def test_the_longest_held_prefix_wins_weighed_against_load():
    assert DECODE_QUEUE_WEIGHT_BLOCKS == 2.0
    assert rank_decode([0, 0], [10, 90], [3, 0]) == [0, 1]  # its history beats free blocks
    assert rank_decode([1, 0], [10, 90], [3, 0]) == [0, 1]  # 3 - 2 = 1 > 0
    assert rank_decode([2, 0], [10, 90], [3, 0]) == [1, 0]  # 3 - 4 < 0: too busy
    assert rank_decode([1, 0], [10, 90], [2, 0]) == [1, 0]  # a tie: the shorter queue
    assert rank_decode([0, 0, 0], [5, 5, 5], [1, 4, 2]) == [1, 2, 0]
    assert rank_decode([5, 0], [5, 5], [4, 0], queue_weight=0) == [0, 1]


def test_rank_decode_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="one overlap and free count per worker"):
        rank_decode([0, 0], [1], None)
    with pytest.raises(ValueError, match="queue_weight >= 0"):
        rank_decode([0], [1], [0], queue_weight=-1)


def test_leading_overlap_counts_only_an_unbroken_prefix():
    hashes = hash_full_blocks(list(range(64)), 16)  # 4 blocks
    assert leading_overlap(hashes, frozenset(hashes)) == 4
    assert leading_overlap(hashes, frozenset(hashes[:2])) == 2
    assert leading_overlap(hashes, frozenset(hashes[1:])) == 0  # the first block is missing
    assert leading_overlap([], frozenset(hashes)) == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_prefix_record_keeps_the_newest_within_capacity_and_ttl():
    clock = Clock()
    record = PrefixRecord(capacity=3, ttl_s=10.0, clock=clock)
    record.add([1, 2])
    clock.now = 5.0
    record.add([3, 1])  # 1 is refreshed: newest
    assert record.hashes() == [2, 3, 1]
    record.add([4])  # over capacity: the oldest (2) goes
    assert record.hashes() == [3, 1, 4]
    clock.now = 15.0  # every hash was added at 5.0: all expire at 15.0
    assert record.hashes() == []
    with pytest.raises(ValueError, match="capacity must be >= 1 and ttl_s > 0, got 0 and 1"):
        PrefixRecord(capacity=0, ttl_s=1)


def test_the_gateway_asks_the_decode_worker_that_published_the_prefix_first(redis_server):
    block_size = 16
    prompt = list(range(1000, 1000 + 4 * block_size + 3))  # 4 full blocks
    config = RedisConfig(redis_server.url)

    async def scenario() -> None:
        regs = [WorkerRegistration(config, WorkerInfo("decode", "m", "f", block_size, 100, 8),
                                   "127.0.0.1", f"decode-{i}") for i in range(2)]
        for port, reg in enumerate(regs, start=7101):
            await reg.start(port)
        discovery = await RedisDiscovery.connect(config)
        backend = DisaggregatedBackend(discovery, tokenizer=None)
        backend.pools.block_size = block_size
        await backend.pools.discover()
        for w in backend.decode:
            w.is_healthy = True
        assert [w.worker_id for w in await backend.admission.decode_order(prompt)] == [
            "decode-0", "decode-1"]  # nothing published: list order
        regs[1].publish_prefix(hash_full_blocks(prompt, block_size))  # as DecodeWorker does
        await asyncio.sleep(0.2)
        assert [w.worker_id for w in await backend.admission.decode_order(prompt)] == [
            "decode-1", "decode-0"]
        backend.decode[1].in_flight = 3  # 4 - 6 < 0: the idle worker first
        assert [w.worker_id for w in await backend.admission.decode_order(prompt)] == [
            "decode-0", "decode-1"]
        for reg in regs:
            await reg.stop()
        await backend.close()

    asyncio.run(scenario())
