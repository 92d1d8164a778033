"""Serving metrics from per-request timings, named as in `vllm bench serve`'s result file.

Per request (all times in seconds from the moment the request was sent):

    sent ---- ttft ----> first token ---- itl[0] ---> token 2 ---- itl[1] ---> ... last token
    |<---------------------------------- latency (e2el) ---------------------------------->|

    TPOT = (latency - ttft) / (output_len - 1)       (0 for a one-token output, as vLLM)
    ITL  = one entry per output token after the first: a message that brings k tokens a gap g
           after the previous one counts as k entries of g / k (`spread_itl`). vLLM's client
           records one entry per streamed chunk; with one token per chunk the two agree.

Run-level figures divide by the run's duration: request_throughput = completed / duration,
request_goodput = completed requests within every SLO / duration, output_throughput =
output tokens / duration. Latency statistics are over completed requests only; failed ones are
counted in `failed` and their messages kept in `errors`.

Where the time went, from the server: each response's timing breakdown (queue, prefill, KV
transfer, first decode step; where the prompt was prefilled) as medians over the requests that
carried one (`server_timing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
# the server's timing breakdown (the Timing message / the HTTP response's "timing"), seconds
TIMING_PARTS = ("queue_s", "prefill_s", "kv_transfer_s", "first_decode_step_s")


@dataclass
class RequestResult:
    """What the client saw of one request."""

    group: str = "main"  # the workload's lane (mixed: "decode" or "long")
    is_success: bool = False
    is_incomplete: bool = False  # cancelled at the time limit, or never sent before it
    error: str = ""
    input_len: int = 0  # prompt tokens (the server's count when it reports usage)
    output_len: int = 0  # generated tokens
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # when it was sent, seconds after the run started
    text: str = ""  # the answer (multi-turn: the next turn's history)
    timing: dict[str, float | str] | None = None  # the server's breakdown, if it sent one

    @property
    def tpot(self) -> float:
        if self.output_len <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class SLO:
    """Goodput counts a completed request only if it meets every limit that is set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def is_met(self, r: RequestResult) -> bool:
        if self.ttft_ms is not None and 1000 * r.ttft > self.ttft_ms:
            return False
        return self.tpot_ms is None or 1000 * r.tpot <= self.tpot_ms


def spread_itl(gap: float, num_tokens: int) -> list[float]:
    """The ITL entries of `num_tokens` tokens that arrived together `gap` seconds after the
    previous token (see the module docstring)."""
    if num_tokens < 1:
        return []
    return [gap / num_tokens] * num_tokens


def stats_ms(values_s: Sequence[float], name: str,
             percentiles: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """mean_/median_/std_/p<q>_<name>_ms of values given in seconds (0 for no values, as
    vLLM reports an empty list)."""
    a = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = float(np.percentile(a, q))
    return out


def compute_metrics(results: Sequence[RequestResult], duration_s: float, slo: SLO,
                    percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | int]:
    """The run-level figures of `vllm bench serve` (BenchmarkMetrics), plus `incomplete`."""
    if duration_s <= 0 or math.isnan(duration_s):
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in results if r.is_success]
    total_input = sum(r.input_len for r in done)
    total_output = sum(r.output_len for r in done)
    num_good = sum(slo.is_met(r) for r in done)
    out: dict[str, float | int] = {
        "completed": len(done),
        "failed": sum(not r.is_success and not r.is_incomplete for r in results),
        "incomplete": sum(r.is_incomplete for r in results),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": num_good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    out.update(stats_ms([r.ttft for r in done], "ttft", percentiles))
    out.update(stats_ms([r.tpot for r in done if r.output_len > 1], "tpot", percentiles))
    out.update(stats_ms([x for r in done for x in r.itl], "itl", percentiles))
    out.update(stats_ms([r.latency for r in done], "e2el", percentiles))
    out.update(server_timing(done))
    return out


def server_timing(results: Sequence[RequestResult]) -> dict[str, float | int]:
    """median_<part>_ms of the server's breakdown and prefill_<where>_share (local, remote,
    colocated) over the results that carried one; nothing if none did."""
    timed = [r.timing for r in results if r.timing]
    if not timed:
        return {}
    out: dict[str, float | int] = {"num_timed": len(timed)}
    for part in TIMING_PARTS:
        out[f"median_{part[:-2]}_ms"] = 1000.0 * float(np.median([float(t.get(part, 0.0))
                                                                   for t in timed]))
    for where in sorted({str(t.get("prefill_where", "")) for t in timed} - {""}):
        out[f"prefill_{where}_share"] = sum(t.get("prefill_where") == where
                                            for t in timed) / len(timed)
    return out


def per_request(results: Sequence[RequestResult]) -> dict[str, list]:
    """The per-request lists of vLLM's result file, in the order the requests were issued
    (failed ones included, with ttft 0 and their error)."""
    return {
        "input_lens": [r.input_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "start_times": [r.start for r in results],
        "request_groups": [r.group for r in results],
        "errors": [r.error for r in results],
    }
