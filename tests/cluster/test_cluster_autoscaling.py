"""Each pool's autoscaling signal (service_infra/metrics/autoscaling.py) tracks that pool's own
saturation, on a cluster of one prefill and one decode host: a prefill-heavy mix (long
prompts, two output tokens) drives pdserve:prefill_queue_ttft_seconds above its target while
the decode pool's signals stay below theirs; a decode-heavy mix (short prompts, long outputs,
more streams than --max-num-seqs) drives pdserve:decode_batch_usage_perc above its target
while the prefill pool's stays below. The old HPA signal, the workers'
pdserve:num_requests_waiting, reads 0 meanwhile: the streams that do not fit wait at the
gateway.

The targets are the test's, sized for the tiny model (a prefill worker computes ~18k prompt
tokens/s on one thread here); the chart's defaults are for real models
(helm/pdserve/values.yaml, autoscaling)."""

from __future__ import annotations

import threading

import pytest

from tests.cluster.cluster_checks import Load, check_quiescent, scrape

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PREFILL_TARGET_S = 0.5  # pdserve:prefill_queue_ttft_seconds
DECODE_TARGET = 0.8  # pdserve:decode_batch_usage_perc and pdserve:kv_cache_usage_perc
MAX_NUM_SEQS = 32
SIGNALS = ("pdserve:prefill_queue_ttft_seconds", "pdserve:prefill_queue_tokens",
           "pdserve:decode_batch_usage_perc", "pdserve:kv_cache_usage_perc",
           "pdserve:num_requests_waiting")


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    return cluster_factory(num_prefill=1, num_decode=1,
                           decode_args=("--max-num-seqs", str(MAX_NUM_SEQS)))


class Peaks:
    """The highest value of each signal per pool, scraped from every worker every 0.1 s."""

    def __init__(self, cluster) -> None:
        self.urls = [w.metrics_url for w in cluster.live()]
        self.peak: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for url in self.urls:
                for s in scrape(url):
                    if s.name in SIGNALS:
                        key = (s.labels["pool"], s.name.removeprefix("pdserve:"))
                        self.peak[key] = max(self.peak.get(key, 0.0), s.value)
            self._stop.wait(0.1)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def run_mix(cluster, prompts: list[list[int]], max_tokens: int, concurrency: int) -> Peaks:
    with Peaks(cluster) as peaks:
        outcomes = Load(cluster, prompts, max_tokens, concurrency, timeout_s=120).results(180)
    assert [o.code for o in outcomes] == [None] * len(prompts), [o.details for o in outcomes]
    check_quiescent(cluster)
    return peaks


def test_a_prefill_heavy_mix_raises_the_prefill_signal_only(cluster):
    prompts = [[3 + (17 * i + j) % 500 for j in range(1000)] for i in range(48)]
    peak = run_mix(cluster, prompts, 2, 16).peak  # at most 16 of 32 sequences reserved
    assert peak["prefill", "prefill_queue_ttft_seconds"] > PREFILL_TARGET_S, peak
    assert peak["prefill", "prefill_queue_tokens"] >= 10 * 1000, peak
    assert peak["decode", "decode_batch_usage_perc"] < DECODE_TARGET, peak
    assert peak["decode", "kv_cache_usage_perc"] < DECODE_TARGET, peak


def test_a_decode_heavy_mix_raises_the_decode_signal_only(cluster):
    prompts = [[3 + (19 * i + j) % 500 for j in range(8)] for i in range(64)]
    peak = run_mix(cluster, prompts, 300, 48).peak
    assert peak["decode", "decode_batch_usage_perc"] > DECODE_TARGET, peak
    assert peak["decode", "kv_cache_usage_perc"] > 0, peak
    assert peak["prefill", "prefill_queue_ttft_seconds"] < PREFILL_TARGET_S, peak
    # what the chart's HPAs used to scale on: 0 throughout, as the issue found
    assert peak["decode", "num_requests_waiting"] == 0, peak
