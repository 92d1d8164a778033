"""The offload tiers under a real engine (tiny random Llama): a pool too small for the
working set evicts chats, and a returning one loads its history from a tier instead of
recomputing it, with the same greedy output (and, in float32, the same logprobs) as without
tiers; a restart on the same directory serves the old entries; corrupt entries and a Redis
value overwritten are misses; preemption swaps back through the tier; an abort while loading
frees every block."""

from __future__ import annotations

import random

import pytest
import redis

from engine_core.engine import LLMEngine
from engine_core.engine_config import CacheConfig, DeviceConfig, KVOffloadConfig, LoadConfig
from engine_core.kv_cache.block_hash import hash_full_blocks, private_block_hash
from engine_core.kv_offload.entry import HEADER_NBYTES, decode_entry
from engine_core.request import RequestStatus
from engine_core.sampling_params import SamplingParams
from tests.redis_server import run_redis
from tests.tiny_model import write_tiny_llama

NUM_BLOCKS = 24  # 16-token blocks: one 200-token history is 13 of them
rng = random.Random(0)
HISTORIES = [[rng.randrange(3, 250) for _ in range(200)] for _ in range(5)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_engine(tiny, offload: KVOffloadConfig | None = None, dtype: str | None = None,
                num_blocks: int = NUM_BLOCKS, cache_decoded_blocks: bool = False) -> LLMEngine:
    return LLMEngine(LoadConfig(str(tiny), dtype=dtype), DeviceConfig("cpu"),
                     CacheConfig(num_blocks=num_blocks, offload=offload or KVOffloadConfig(),
                                 cache_decoded_blocks=cache_decoded_blocks))


def generate(engine: LLMEngine, prompts, params=GREEDY, prefix="r"):
    """Each prompt alone (a chat's turn after the others ran): tokens and logprobs."""
    results = []
    for i, prompt in enumerate(prompts):
        req_id = f"{prefix}{i}"
        engine.add_request(prompt, params, req_id=req_id)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    results.append((list(c.token_ids), c.logprobs, out.num_cached_tokens))
    engine.flush_offload(wait=True)
    engine.kv.check_integrity()
    return results


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until every request ends: each one's tokens by request id; then its stores are
    flushed and the pool's books checked."""
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    engine.flush_offload(wait=True)
    engine.kv.check_integrity()
    return out


def in_step(engine: LLMEngine) -> list[int]:
    """Make the engine's stores finish before its next step (its pins end, a preempted
    request's swapped blocks are in the tier before it is admitted again), so that a run does
    not depend on the threads' pace; returns the list of the hashes its loads ask for."""
    off, loaded = engine.offloader, []
    load, store, swap_out = off.load, off.store, off.swap_out
    off.load = lambda req_id, blocks, hashes: (loaded.extend(hashes), load(req_id, blocks, hashes))
    off.store = lambda *a: (store(*a), off.drain())
    off.swap_out = lambda blocks: (swap_out(blocks), off.drain())
    return loaded


def tokens(results):
    return [r[0] for r in results]


def two_rounds(engine):
    """Every history, then every history again: the pool holds fewer than two, so the second
    round's prefixes were evicted (from the pool) by the others."""
    return generate(engine, HISTORIES, prefix="a"), generate(engine, HISTORIES, prefix="b")


def tier(engine, name="disk"):
    return next(t for t in engine.offloader.tiers if t.name == name)


@pytest.mark.parametrize(("dtype", "tier_name"), [(None, "disk"), ("float32", "disk"),
                                                  ("float32", "cpu")])
def test_returning_chats_load_from_a_tier_with_the_same_output(tiny, tmp_path, dtype,
                                                               tier_name, monkeypatch):
    """The disk tier, and the host RAM tier of a CUDA engine: on a CPU engine it is off (the
    pool is host RAM); here the CPU platform is told otherwise, so that the tier runs the
    engine's path (everything but the device copies, which are CUDA's)."""
    plain = make_engine(tiny, dtype=dtype)
    base_first, base_again = two_rounds(plain)
    assert all(cached == 0 for *_, cached in base_again)  # evicted: recomputed
    if tier_name == "cpu":
        from engine_core.platforms.cpu import CpuPlatform

        monkeypatch.setattr(CpuPlatform, "kv_in_host_memory", False)
        config = KVOffloadConfig(cpu_gb=0.5)
    else:
        config = KVOffloadConfig(disk_dir=str(tmp_path))
    tiered = make_engine(tiny, config, dtype=dtype)
    assert [t.name for t in tiered.offloader.tiers] == [tier_name]
    first, again = two_rounds(tiered)
    assert tokens(first) == tokens(base_first) and tokens(again) == tokens(base_again)
    if dtype == "float32":  # the same KV bytes: the same logits
        assert [r[1] for r in again] == [r[1] for r in base_again]
    full = (len(HISTORIES[0]) - 1) // 16 * 16  # every full block but the one with the last
    assert [cached for *_, cached in again] == [full] * len(HISTORIES)
    stats = tier(tiered, tier_name).stats
    assert stats.hits == len(HISTORIES) * full // 16 and stats.corrupt == 0
    assert stats.stores >= len(HISTORIES) * full // 16
    # the gateways weigh a tier hit with the measured load speed, and bound the blocks they
    # record as stored by the largest tier's size
    off = tiered.offloader
    assert off.load_tokens_per_s > 0 and off.num_blocks_loaded == stats.hits
    entry = off.payload_nbytes + 48
    assert off.capacity_blocks == max(t.capacity_bytes for t in off.tiers) // entry > 0
    tiered.close()


def test_a_restart_on_the_same_directory_serves_the_old_entries(tiny, tmp_path):
    config = KVOffloadConfig(disk_dir=str(tmp_path))
    before = make_engine(tiny, config)
    cold = generate(before, HISTORIES[:2])
    before.close()
    after = make_engine(tiny, config)  # a new process would see the same files
    warm = generate(after, HISTORIES[:2])
    assert tokens(warm) == tokens(cold)
    assert all(cached > 0 for *_, cached in warm) and tier(after).stats.hits > 0
    after.close()


def test_corrupt_entries_are_misses_and_the_output_stands(tiny, tmp_path):
    config = KVOffloadConfig(disk_dir=str(tmp_path))
    engine = make_engine(tiny, config)
    first = generate(engine, HISTORIES)
    engine.close()
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for i, f in enumerate(files):  # a flipped byte in every other one, the rest truncated
        data = bytearray(f.read_bytes())
        if i % 2:
            data[HEADER_NBYTES + 5] ^= 0xFF
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 2]))
    engine = make_engine(tiny, config)
    again = generate(engine, HISTORIES)
    assert tokens(again) == tokens(first)
    stats = tier(engine).stats
    assert stats.corrupt == len(HISTORIES) and stats.hits == 0  # each load stops at its first
    engine.close()
    # what the requests recomputed replaced the damaged entries: all valid again
    ns = engine.offloader.ns
    for f in files:
        block_hash = int(f.stem.rsplit("-", 1)[1], 16)
        assert decode_entry(f.read_bytes(), ns, block_hash,
                            engine.offloader.payload_nbytes) is not None, f


def test_a_history_prefilled_by_one_engine_loads_in_another_through_redis(tiny, tmp_path):
    """Two engines (two prefill workers) share a Redis: a chat prefilled by A returns to B and
    loads; a value overwritten in Redis is a corrupt miss."""
    with run_redis(tmp_path) as server:
        config = KVOffloadConfig(redis_url=server.url)
        a, b = make_engine(tiny, config), make_engine(tiny, config)
        on_a = generate(a, HISTORIES[:2])
        on_b = generate(b, HISTORIES[:2])
        assert tokens(on_b) == tokens(on_a)
        assert tier(b, "redis").stats.hits == 2 * 12
        client = redis.Redis.from_url(server.url)
        keys = [k for k in client.keys(tier(a, "redis").prefix + "*")
                if not k.endswith((b":lru", b":bytes"))]
        for k in keys:
            client.set(k, b"not an entry")
        c = make_engine(tiny, config)
        on_c = generate(c, HISTORIES[:2])
        assert tokens(on_c) == tokens(on_a)
        assert tier(c, "redis").stats.corrupt == 2 and tier(c, "redis").stats.hits == 0
        for engine in (a, b, c):
            engine.close()


def test_a_preempted_request_swaps_back_through_the_tier(tiny, tmp_path):
    """Five requests at once in a pool that holds about three as they grow: a preempted
    one's blocks (its prompt's and its reply's) come back from the tier once the others
    evicted them from the pool, with the output of a pool that never preempts (the same KV
    bytes, not a recomputation); with the serving commands' cache_decoded_blocks and with the
    offline default without it."""
    prompts = [h[:100] for h in HISTORIES]
    params = SamplingParams(max_tokens=100, temperature=0.0)

    def batch(engine):
        for i, p in enumerate(prompts):
            engine.add_request(p, params, req_id=f"p{i}")
        return run_all(engine)

    roomy = batch(make_engine(tiny, num_blocks=128, cache_decoded_blocks=True))
    tight = make_engine(tiny, KVOffloadConfig(disk_dir=str(tmp_path)), num_blocks=30,
                        cache_decoded_blocks=True)
    in_step(tight)
    assert batch(tight) == roomy
    assert tight.scheduler.num_preemptions > 0 and tier(tight).stats.hits > 0
    assert tight.offloader.num_swapped_out == 0  # every block it computed was published
    tight.close()

    # the offline default keeps a reply's blocks to itself (cache_decoded_blocks off): they
    # are copied out under keys of their request's own when it is preempted, and it alone
    # loads them back
    private = make_engine(tiny, KVOffloadConfig(disk_dir=str(tmp_path / "private")),
                          num_blocks=30)
    asked = in_step(private)
    got = batch(private)
    assert got == roomy
    assert private.scheduler.num_preemptions > 0 and private.offloader.num_swapped_out > 0
    keys = {private_block_hash(h, req_id)
            for req_id, out in got.items()
            for h in hash_full_blocks(prompts[int(req_id[1:])] + out, 16)[100 // 16:]}
    assert keys & set(asked), "no preempted reply was loaded back from its private keys"
    private.close()


def test_an_abort_while_loading_frees_every_block(tiny, tmp_path):
    config = KVOffloadConfig(disk_dir=str(tmp_path))
    engine = make_engine(tiny, config)
    generate(engine, HISTORIES[:3])  # the first is evicted from the pool, kept on disk
    engine.add_request(HISTORIES[0], GREEDY, req_id="back")
    engine.scheduler.schedule()  # admission: it finds its blocks on disk and loads
    req = engine.scheduler.requests["back"]
    assert req.status is RequestStatus.WAITING_FOR_OFFLOAD
    engine.abort_request("back")
    engine.flush_offload(wait=True)
    assert not engine.scheduler.loading and not engine.scheduler.tiers.orphans
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == NUM_BLOCKS and not engine.kv.pinned
    engine.add_request(HISTORIES[0], GREEDY, req_id="back")  # the id is free again
    engine.close()


def test_random_traffic_with_aborts_leaves_every_block_free(tiny, tmp_path):
    """Chats sharing prefixes, returning after eviction, some aborted at random points
    (waiting, loading, running), in a pool that preempts: at the end every block is free,
    nothing pinned or loading, and the pool's books agree."""
    rng = random.Random(2)
    engine = make_engine(tiny, KVOffloadConfig(disk_dir=str(tmp_path)), num_blocks=40,
                         cache_decoded_blocks=True)
    stems = [[rng.randrange(3, 250) for _ in range(rng.randrange(40, 160))] for _ in range(6)]
    n = 0
    for _ in range(60):
        for _ in range(rng.randrange(0, 3)):
            prompt = rng.choice(stems) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 30),
                                                      temperature=0.0), req_id=f"t{n}")
            n += 1
        if engine.scheduler.requests and rng.random() < 0.3:
            engine.abort_request(rng.choice(list(engine.scheduler.requests)))
        engine.step()
        engine.kv.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush_offload(wait=True)
    engine.kv.check_integrity()
    sched = engine.scheduler
    assert not (sched.requests or sched.loading or sched.tiers.orphans or engine.kv.pinned)
    assert engine.kv.num_free_blocks == 40
    assert tier(engine).stats.hits > 0 and sched.num_preemptions > 0
    engine.close()


def test_a_decode_engine_stores_what_it_computed_and_swaps_what_it_received(tiny, tmp_path):
    """The decode side of handoffs (reserve, the prefill engine's KV copied in, admit) with a
    tier: the prompt blocks it received are not stored by it (their prefill worker does), its
    reply's are; preempted in a pool too small for five growing replies, a request's received
    prompt blocks are copied out under their shared keys and come back from the tier, with
    the output of a pool that never preempts."""
    prompts = [h[:64] for h in HISTORIES]  # 4 full blocks each
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    pre = make_engine(tiny, num_blocks=64)

    class Recorder:  # the scheduler side of a KV connector: the request's blocks
        seen: list[int] = []

        def build_step(self, out, block_ids):
            self.seen = list(block_ids[0])

    def decode_all(dec):
        for i, prompt in enumerate(prompts):
            pre.kv_connector = recorder = Recorder()
            pre.add_request(prompt, first_only, req_id=f"pre{len(pre.scheduler.requests)}-{i}")
            while pre.has_unfinished_requests():
                outs = pre.step()
            pre.kv_connector = None
            first = outs[0].outputs[0].token_ids[0]
            blocks, num_cached = dec.reserve(prompt, params, f"d{i}")
            assert num_cached == 0
            dec.runner.kv_cache[:, blocks[:4]] = pre.runner.kv_cache[:, recorder.seen[:4]]
            dec.admit_prefilled(f"d{i}", first)
        return run_all(dec)

    roomy = decode_all(make_engine(tiny, num_blocks=128, cache_decoded_blocks=True))
    tight = make_engine(tiny, KVOffloadConfig(disk_dir=str(tmp_path)), num_blocks=30,
                        cache_decoded_blocks=True)
    loaded = in_step(tight)
    assert decode_all(tight) == roomy
    assert tight.scheduler.num_preemptions > 0 and tight.offloader.num_swapped_out > 0
    prompt_keys = {h for p in prompts for h in hash_full_blocks(p, 16)}
    disk = tier(tight)
    stored = {int(k.rsplit("-", 1)[1], 16) for k in disk._index}
    swapped_back = prompt_keys & set(loaded)
    assert swapped_back, "no preempted request loaded its received prompt back"
    # the prompts' blocks on disk are only what preemption copied out
    assert len(prompt_keys & stored) <= tight.offloader.num_swapped_out
    assert stored - prompt_keys, "the decoded blocks were not stored"
    tight.close()

    # no preemption: nothing of the received prompts reaches the tier
    calm = make_engine(tiny, KVOffloadConfig(disk_dir=str(tmp_path / "calm")), num_blocks=128,
                       cache_decoded_blocks=True)
    assert decode_all(calm) == roomy
    calm_stored = {int(k.rsplit("-", 1)[1], 16) for k in tier(calm)._index}
    assert calm.scheduler.num_preemptions == 0 and calm_stored
    assert not calm_stored & prompt_keys
    calm.close()
