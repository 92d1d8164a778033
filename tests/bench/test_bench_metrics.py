"""The metric math on hand-computed inputs."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import (
    SLO,
    RequestResult,
    compute_metrics,
    per_request,
    spread_itl,
    stats_ms,
)


def results() -> list[RequestResult]:
    return [
        # TPOT = (0.5 - 0.1) / (5 - 1) = 0.1 s
        RequestResult(is_success=True, input_len=10, output_len=5, ttft=0.1, latency=0.5,
                      itl=[0.1] * 4),
        # TPOT = (1.3 - 0.3) / (3 - 1) = 0.5 s
        RequestResult(is_success=True, input_len=20, output_len=3, ttft=0.3, latency=1.3,
                      itl=[0.5, 0.5]),
        RequestResult(is_success=False, input_len=30, error="HTTP 500: boom"),
        # one token: TPOT counts as 0 for goodput and is left out of the TPOT figures
        RequestResult(is_success=True, input_len=40, output_len=1, ttft=0.2, latency=0.2),
        RequestResult(is_incomplete=True, input_len=50, error="not finished"),
    ]


def test_run_level_figures():
    m = compute_metrics(results(), duration_s=2.0, slo=SLO(ttft_ms=250, tpot_ms=200))
    assert (m["completed"], m["failed"], m["incomplete"]) == (3, 1, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (70, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(39.5)
    # within both SLOs: the first (100 ms, 100 ms) and the one-token one (200 ms, 0);
    # the second misses the TTFT limit (300 ms > 250 ms)
    assert m["request_goodput"] == pytest.approx(1.0)


def test_latency_statistics_in_ms():
    m = compute_metrics(results(), duration_s=2.0, slo=SLO())
    # TTFT over completed requests: [100, 300, 200] ms
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert m["p50_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280)  # linear: 200 + 0.8 * 100
    assert m["p99_ttft_ms"] == pytest.approx(298)
    # TPOT over outputs longer than one token: [100, 500] ms
    assert m["mean_tpot_ms"] == pytest.approx(300)
    assert m["p90_tpot_ms"] == pytest.approx(460)
    # ITL pooled over requests: four of 100 ms, two of 500 ms
    assert m["mean_itl_ms"] == pytest.approx(1400 / 6)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["p99_itl_ms"] == pytest.approx(500)
    assert m["mean_e2el_ms"] == pytest.approx(2000 / 3)
    assert m["request_goodput"] == pytest.approx(1.5)  # no SLO: every completed request


def test_slo_limits_each_apply_alone():
    r = RequestResult(is_success=True, output_len=11, ttft=0.5, latency=2.5)  # TPOT 200 ms
    assert SLO(ttft_ms=500).is_met(r) and not SLO(ttft_ms=499).is_met(r)
    assert SLO(tpot_ms=200).is_met(r) and not SLO(tpot_ms=199).is_met(r)
    assert SLO().is_met(r)


def test_spread_itl_divides_a_multi_token_message():
    assert spread_itl(0.3, 3) == pytest.approx([0.1, 0.1, 0.1])
    assert spread_itl(0.2, 1) == [0.2]
    assert spread_itl(0.2, 0) == []


def test_empty_run_reports_zeros_not_nan():
    m = compute_metrics([RequestResult(error="refused")], duration_s=1.0, slo=SLO())
    assert (m["completed"], m["failed"]) == (0, 1)
    assert m["mean_ttft_ms"] == m["p99_itl_ms"] == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], duration_s=0.0, slo=SLO())


def test_stats_keys_and_per_request_lists():
    assert set(stats_ms([0.001], "x", (50, 99.9))) == {
        "mean_x_ms", "median_x_ms", "std_x_ms", "p50_x_ms", "p99.9_x_ms"}
    lists = per_request(results())
    assert lists["ttfts"] == [0.1, 0.3, 0.0, 0.2, 0.0]
    assert lists["itls"][1] == [0.5, 0.5]
    assert lists["errors"][2] == "HTTP 500: boom"
    assert len(lists["input_lens"]) == len(lists["output_lens"]) == 5
