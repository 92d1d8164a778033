"""service_infra/metrics/autoscaling.py on a real engine (a tiny random Llama): the prefill
signal counts the prompt tokens not computed yet and prices them at the measured speed; the
decode signal counts running and reserved sequences against --max-num-seqs, and reserved
prompts count in kv_cache_usage_perc."""

from __future__ import annotations

import pytest

from engine_core.engine import LLMEngine
from engine_core.engine_config import CacheConfig, LoadConfig, SchedulerConfig
from engine_core.sampling_params import SamplingParams
from service_infra.metrics.autoscaling import AutoscalingCollector
from service_infra.metrics.worker import worker_registry
from tests.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory):
    folder = str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))

    def make(max_num_seqs: int = 4, max_num_batched_tokens: int = 64) -> LLMEngine:
        return LLMEngine(LoadConfig(folder, dtype="float32"), cache_config=CacheConfig(
            kv_cache_memory_gb=0.01), scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens))

    return make


def signals(registry) -> dict[str, float]:
    return {s.name.removeprefix("pdserve:"): s.value for f in registry.collect()
            for s in f.samples if s.name.startswith("pdserve:")}


def test_prefill_queue_tokens_and_the_ttft_they_imply(make_engine):
    engine = make_engine()
    registry = worker_registry("prefill", "tiny", engine)
    assert signals(registry)["prefill_queue_tokens"] == 0
    assert signals(registry)["prefill_queue_ttft_seconds"] == 0  # nothing queued, no speed
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(3):
        engine.add_request(list(range(3 + i, 103 + i)), params)  # 100 tokens each
    assert signals(registry)["prefill_queue_tokens"] == 300
    engine.step()  # a 64-token budget: 64 of the first prompt computed, and the speed measured
    got = signals(registry)
    assert got["prefill_queue_tokens"] == 236
    speed = engine.stats.prefill_tokens_per_s
    assert speed > 0 and got["prefill_queue_ttft_seconds"] == pytest.approx(236 / speed)
    while engine.has_unfinished_requests():
        engine.step()
    assert signals(registry)["prefill_queue_tokens"] == 0
    assert "decode_batch_usage_perc" not in got


def test_decode_batch_and_kv_usage_count_reserved_sequences(make_engine):
    engine = make_engine(max_num_seqs=4)
    registry = worker_registry("decode", "tiny", engine)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert signals(registry)["decode_batch_usage_perc"] == 0
    assert signals(registry)["kv_cache_usage_perc"] == 0
    assert engine.reserve(list(range(3, 35)), params, "r0") is not None  # 2 blocks, KV to come
    got = signals(registry)
    assert got["decode_batch_usage_perc"] == 0.25
    assert got["kv_cache_usage_perc"] == pytest.approx(2 / engine.kv.pool.num_blocks)
    for i in range(3):
        engine.add_request([3 + i, 4, 5], params)
    engine.step()  # three running, one reserved: the limit reached
    assert signals(registry)["decode_batch_usage_perc"] == 1.0
    assert "prefill_queue_tokens" not in got


def test_a_pool_is_prefill_or_decode(make_engine):
    with pytest.raises(ValueError, match="prefill or decode"):
        AutoscalingCollector("gateway", "tiny", object())
