"""Prometheus metrics scraped live from a `pdserve up` stack (gateway, prefill and decode
workers; speculative n-gram decoding on): names, types and the `model_name` label; counters
that move with a request, a rejection and an abort; gauges back to zero at idle; and every
query of the shipped Grafana dashboard names a metric the services export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.pdserve.v1 import generate_pb2 as pb
from service_infra.metrics.gpu import GPUCollector
from tests.e2e.stack import MODEL, Stack, greedy, out_ids, run

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).parents[2] / "helm" / "pdserve" / "dashboards" / "pdserve.json"
COPY = "Repeat exactly: red, green, blue, red, green, blue, red, green,"

H, C, G = "histogram", "counter", "gauge"
GATEWAY = {
    "time_to_first_token_seconds": H, "inter_token_latency_seconds": H,
    "request_time_per_output_token_seconds": H, "e2e_request_latency_seconds": H,
    "request_queue_time_seconds": H, "request_prefill_time_seconds": H,
    "request_kv_transfer_time_seconds": H, "request_first_decode_step_time_seconds": H,
    "request_decode_time_seconds": H, "request_prompt_tokens": H,
    "request_generation_tokens": H, "prompt_tokens": C, "generation_tokens": C,
    "request_success": C, "requests_rejected": C, "requests_aborted": C,
    "num_requests_running": G, "num_requests_waiting": G, "healthy_workers": G,
    "prefill_decisions": C,
}
ENGINE = {
    "num_requests_running": G, "num_requests_waiting": G, "num_requests_reserved": G,
    "kv_cache_usage_perc": G, "cache_config_info": G, "weights_info": G,
    "prefix_cache_queries": C,
    "prefix_cache_hits": C, "num_preemptions": C, "iteration_tokens_total": H,
    "engine_prompt_tokens": C, "engine_generation_tokens": C, "engine_forks": C,
    # the stack's disk offload tier (conftest.py spec_stack)
    "kv_offload_hits": C, "kv_offload_misses": C, "kv_offload_stores": C,
    "kv_offload_evictions": C, "kv_offload_corrupt": C, "kv_offload_errors": C,
    "kv_offload_loaded_bytes": C, "kv_offload_bytes": G, "kv_offload_load_seconds": H,
    "kv_offload_store_seconds": H, "kv_offload_store_skipped": C,
}
PREFILL = {**ENGINE, "kv_transfer_time_seconds": H, "kv_transfer_bytes": H,
           "kv_transfer_failures": C, "kv_transport_info": G, "kv_transfers_active": G}
DECODE = {**ENGINE, "kv_leases_active": G, "kv_leases_ended": C, "spec_decode_num_drafts": C,
          "spec_decode_num_draft_tokens": C, "spec_decode_num_accepted_tokens": C,
          "spec_decode_num_accepted_tokens_per_pos": C,
          "spec_decode_num_draft_tokens_per_pos": C}


@pytest.fixture(scope="module")
def stack(spec_stack):
    return spec_stack


def scrape(url: str) -> dict:
    """{family name: family} of one /metrics endpoint."""
    text = httpx.get(url, timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def scrape_all(stack: Stack) -> tuple[dict, dict, dict]:
    gateway, prefill, decode = stack.metrics  # `pdserve up` prints them in this order
    return scrape(gateway), scrape(prefill), scrape(decode)


def value(families: dict, name: str, suffix: str = "", **labels) -> float:
    """The sum of the samples of `pdserve:<name><suffix>` whose labels include `labels`."""
    family = families["pdserve:" + name]
    return sum(s.value for s in family.samples if s.name == family.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_metric_exists_with_its_type_and_model_label(stack):
    stack.wait_idle()
    for families, expected in zip(scrape_all(stack), (GATEWAY, PREFILL, DECODE), strict=True):
        for name, kind in expected.items():
            family = families.get("pdserve:" + name)
            assert family is not None, f"pdserve:{name} not exported"
            assert family.type == kind, (name, family.type)
            assert all(s.labels.get("model_name") == MODEL for s in family.samples), name


def test_counters_move_with_a_request(stack, ref):
    gw0, pf0, dc0 = scrape_all(stack)
    msgs = run(stack.generation(), pb.GenerateRequest(text=COPY, sampling=greedy(24)))
    n_out, n_prompt = len(out_ids(msgs)), msgs[-1].usage.prompt_tokens
    stack.wait_idle()
    gw, pf, dc = scrape_all(stack)
    d = lambda new, old, *a, **kw: value(new, *a, **kw) - value(old, *a, **kw)  # noqa: E731
    assert d(gw, gw0, "time_to_first_token_seconds", "_count") == 1
    assert d(gw, gw0, "e2e_request_latency_seconds", "_count") == 1
    assert d(gw, gw0, "request_kv_transfer_time_seconds", "_count") == 1
    assert d(gw, gw0, "inter_token_latency_seconds", "_count") >= 1
    assert d(gw, gw0, "generation_tokens", "_total") == n_out
    assert d(gw, gw0, "prompt_tokens", "_total") == n_prompt
    assert d(gw, gw0, "request_success", "_total", finished_reason="length") == 1
    # `pdserve up`'s default policy sends every prompt to the prefill pool
    assert d(gw, gw0, "prefill_decisions", "_total", where="remote", reason="policy") == 1
    assert d(pf, pf0, "prefix_cache_queries", "_total") > 0
    assert d(pf, pf0, "engine_prompt_tokens", "_total") > 0
    assert d(pf, pf0, "kv_transfer_time_seconds", "_count", transport="shm") == 1
    assert d(pf, pf0, "kv_transfer_bytes", "_sum", transport="shm") > 0
    assert value(pf, "kv_transport_info", transport="shm") == 1
    # one series per (prefill, decode) pair in use, named by both ends
    (pair,) = [p.labels for p in pf["pdserve:kv_transport_info"].samples]
    assert pair["prefill"] == stack.prefill[0] and pair["transport"] == "shm"
    assert pair["control"] == "unix"  # LayerDone and Commit on the decode worker's socket
    assert pair["decode"].rsplit(":", 1)[0] == stack.decode[0].rsplit(":", 1)[0]
    assert d(dc, dc0, "kv_leases_ended", "_total", state="CLAIMED") == 1
    assert d(dc, dc0, "iteration_tokens_total", "_count") >= 1
    # the output copies the prompt: the n-gram proposer drafted, and some drafts held
    assert d(dc, dc0, "spec_decode_num_draft_tokens", "_total") > 0
    assert d(dc, dc0, "spec_decode_num_accepted_tokens", "_total") > 0
    assert d(dc, dc0, "spec_decode_num_accepted_tokens_per_pos", "_total", position="0") > 0
    for families in (gw, pf, dc):  # idle again
        assert value(families, "num_requests_running") == 0
        assert value(families, "num_requests_waiting") == 0
    assert value(dc, "kv_cache_usage_perc") == 0 and value(dc, "kv_leases_active") == 0
    assert value(pf, "kv_transfers_active") == 0
    assert value(gw, "healthy_workers", pool="prefill") == 1
    assert value(gw, "healthy_workers", pool="decode") == 1


def test_rejections_and_aborts_are_counted(stack):
    gw0 = scrape(stack.metrics[0])
    stub = stack.generation()
    with pytest.raises(grpc.RpcError) as info:
        run(stub, pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(
            max_tokens=4, temperature=-1.0)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = httpx.post(f"{stack.http_url}/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400
    call = stub.Generate(pb.GenerateRequest(text="Count to a thousand:",
                                            sampling=greedy(500, ignore_eos=True)), timeout=60)
    next(call)
    call.cancel()
    stack.wait_idle()
    gw = scrape(stack.metrics[0])
    assert value(gw, "requests_rejected", "_total", reason="invalid_argument") - value(
        gw0, "requests_rejected", "_total", reason="invalid_argument") == 2
    assert value(gw, "requests_aborted", "_total", reason="client_disconnected") - value(
        gw0, "requests_aborted", "_total", reason="client_disconnected") == 1
    assert value(gw, "num_requests_running", pool="gateway") == 0


class FakeNVML:
    """pynvml's calls for one GPU (no GPU here: the collector's output format is checked)."""

    def nvmlInit(self): ...
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetUUID(self, h): return b"GPU-0000"
    def nvmlDeviceGetUtilizationRates(self, h): return type("U", (), {"gpu": 37})()
    def nvmlDeviceGetMemoryInfo(self, h): return type("M", (), {"used": 2**30, "total": 2**34})()
    def nvmlDeviceGetPowerUsage(self, h): return 123_000  # milliwatts


class MigNVML(FakeNVML):
    """Two cards; the first in MIG mode, where NVML cannot read utilization."""

    def nvmlDeviceGetCount(self): return 2
    def nvmlDeviceGetUUID(self, h): return f"GPU-000{h}".encode()

    def nvmlDeviceGetUtilizationRates(self, h):
        if h == 0:
            raise RuntimeError("Not Supported")
        return super().nvmlDeviceGetUtilizationRates(h)


def test_a_quantity_nvml_cannot_read_is_left_out_for_that_card_only(caplog):
    collector = GPUCollector(MigNVML())
    for _ in range(2):  # said once, not at every scrape
        with caplog.at_level("INFO", logger="service_infra.metrics.gpu"):
            series = {(s.name, s.labels["gpu"]): s.value
                      for f in collector.collect() for s in f.samples}
    assert ("pdserve:gpu_utilization_perc", "0") not in series
    assert series[("pdserve:gpu_utilization_perc", "1")] == 0.37
    for gpu in "01":
        assert series[("pdserve:gpu_memory_total_bytes", gpu)] == 2**34
        assert series[("pdserve:gpu_power_watts", gpu)] == 123.0
    said = [r.message for r in caplog.records if "cannot read" in r.message]
    assert said == ["GPU 0: NVML cannot read pdserve:gpu_utilization_perc (Not Supported); "
                    "not exported"]


def test_dashboard_queries_name_exported_metrics(stack):
    """Every metric a panel queries is exported by a running service (scraped above), or, for
    the GPU panels, by the NVML collector (which exports nothing on this GPU-less machine)."""
    exported = set()
    for families in scrape_all(stack):
        exported |= {s.name for f in families.values() for s in f.samples}
        # a labelled counter without samples yet: its family, as PromQL would name it
        exported |= {f.name + "_total" for f in families.values() if f.type == "counter"}
    gpu = {s.name for f in GPUCollector(FakeNVML()).collect() for s in f.samples}
    assert not list(GPUCollector().collect())  # no GPU here: no series, no error
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    assert len(exprs) >= 25
    used = {m for e in exprs for m in re.findall(r"pdserve:[A-Za-z0-9_:]+", e)}
    missing = sorted(m for m in used if m not in exported and m not in gpu)
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"
    assert {m for m in used if m in gpu} == gpu  # every GPU series has a panel
    titles = {p["title"] for p in dashboard["panels"]}
    for needed in ("Time to first token", "TTFT breakdown (mean)", "Inter-token latency",
                   "KV cache usage per pool", "Transfer speed",
                   "Acceptance rate per draft position", "GPU utilisation"):
        assert needed in titles
