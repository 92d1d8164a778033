"""A real Prometheus (Debian's package) scrapes a live `pdserve up` stack (gateway, prefill and
decode workers, n-gram speculation on) every second while traffic runs: every panel query of
the shipped Grafana dashboard, and its model_name variable, evaluated through Prometheus'
HTTP API, returns data; the chart's SLO rules load, evaluate without error, and the recording
rules return data.

The traffic: greedy streams that copy their prompt (speculative drafts accepted), a rejected
request and a client abort in every round, and one KV transfer refused at the start (a
Prefill into a lease that does not exist), so that every counter a panel reads has moved.
The GPU panels read the NVML collector's series: there is no GPU here, so a fourth scrape
target serves service_infra/metrics/gpu.py's collector over a fake NVML (the one stand-in;
test_e2e_metrics.py checks its format). The KV offload panels need chats that return after a
pool evicted them, which this traffic never makes the stack's pools do: a fifth target serves
the engine collector of a real engine (tests/tiny_model.py's Llama, a disk tier, a pool of 24
blocks) kept busy by such chats, labelled with the stack's model name."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import threading
import time
import uuid
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.v1 import generate_pb2 as pb
from service_infra.metrics.gpu import GPUCollector
from service_infra.metrics.http import serve_metrics
from tests.e2e.stack import MODEL, greedy, run
from tests.e2e.test_e2e_metrics import COPY, DASHBOARD, FakeNVML
from tests.helpers import prometheus_tool, wait_until
from tests.redis_server import free_port

pytestmark = pytest.mark.slow

RATE_INTERVAL = "10s"  # $__rate_interval: at least 4 scrapes of 1 s
TRAFFIC_S = 12.0  # traffic before the queries are evaluated (they are, while it goes on)


@pytest.fixture(scope="module")
def stack(spec_stack):
    return spec_stack


@pytest.fixture(scope="module")
def gpu_target():
    registry = CollectorRegistry()
    registry.register(GPUCollector(FakeNVML()))
    server = serve_metrics(registry, "127.0.0.1", 0)  # the workers' endpoint
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def offload_target(tmp_path_factory):
    from engine_core.engine import LLMEngine
    from engine_core.engine_config import CacheConfig, DeviceConfig, KVOffloadConfig, LoadConfig
    from engine_core.sampling_params import SamplingParams
    from service_infra.metrics.worker import EngineCollector
    from tests.tiny_model import write_tiny_llama

    folder = tmp_path_factory.mktemp("offload-target")
    engine = LLMEngine(LoadConfig(str(write_tiny_llama(folder / "model"))), DeviceConfig("cpu"),
                       CacheConfig(num_blocks=24,
                                   offload=KVOffloadConfig(disk_dir=str(folder / "kv"))))
    registry = CollectorRegistry()
    registry.register(EngineCollector("prefill", MODEL, engine))
    server = serve_metrics(registry, "127.0.0.1", 0)
    stop = threading.Event()
    rng = random.Random(0)

    def chats() -> None:
        """Four 200-token chats in turn (13 blocks each: the pool holds fewer than two, so
        each returns from the tier), one replaced by a new one every round (stores)."""
        histories = [[rng.randrange(3, 250) for _ in range(200)] for _ in range(4)]
        params = SamplingParams(max_tokens=2, temperature=0.0)
        for i in itertools.count():
            if stop.is_set():
                return
            for j, prompt in enumerate(histories):
                engine.add_request(prompt, params, req_id=f"chat-{i}-{j}")
                while engine.has_unfinished_requests():
                    engine.step_deltas()
            histories[i % 4] = [rng.randrange(3, 250) for _ in range(200)]
            stop.wait(0.2)

    worker = threading.Thread(target=chats, daemon=True)
    worker.start()
    yield f"127.0.0.1:{server.server_port}"
    stop.set()
    worker.join(60)
    server.shutdown()
    engine.close()


def slo_rule_groups() -> list[dict]:
    """The chart's PrometheusRule groups, rendered with the default thresholds."""
    import helm_python as helm

    from tests.helm.chart_testkit import CHART_DIR, render

    with helm.Chart.load(CHART_DIR) as chart:
        (rule,) = render(chart, {"metrics": {"prometheusRule": {"enabled": True}}}).of_kind(
            "PrometheusRule")
    return rule["spec"]["groups"]


@pytest.fixture(scope="module")
def prometheus(stack, gpu_target, offload_target, tmp_path_factory):
    """Prometheus scraping the gateway, the workers and the GPU target every second, with the
    SLO rules loaded: its HTTP API's base URL."""
    folder = tmp_path_factory.mktemp("prometheus")
    (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": slo_rule_groups()}))
    targets = {"gateway": stack.metrics[:1], "prefill": stack.metrics[1:2],
               "decode": stack.metrics[2:3]}
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms",
                   "evaluation_interval": "1s"},
        "rule_files": [str(folder / "rules.yaml")],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [
                url.removeprefix("http://").removesuffix("/metrics") for url in urls]}]}
            for job, urls in targets.items()] + [
            {"job_name": "gpu", "static_configs": [{"targets": [gpu_target]}]},
            {"job_name": "offload", "static_configs": [{"targets": [offload_target]}]}],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(folder / "prometheus.log", "w") as log:
        proc = subprocess.Popen([prometheus_tool("prometheus"),
                                 f"--config.file={folder / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={folder / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url, proc, folder), 60, "prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(url: str, proc: subprocess.Popen, folder: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited: {(folder / 'prometheus.log').read_text()}")
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def refuse_a_transfer(stack) -> None:
    """A Prefill into a lease the decode worker does not hold: the prefill worker counts a
    failed transfer (pdserve:kv_transfer_failures_total)."""
    decode = stack.decode_stub(stack.decode[0])
    rid = f"refused-{uuid.uuid4().hex}"
    ids = list(range(100, 140))
    res = decode.Reserve(wpb.ReserveRequest(request_id=rid, prompt_token_ids=ids,
                                            sampling=greedy(1), lease_ttl_s=10), timeout=10)
    decode.Abort(wpb.AbortRequestRequest(request_id=rid, reason="test"), timeout=10)
    with pytest.raises(grpc.RpcError):
        stack.prefill_stub(stack.prefill[0]).Prefill(wpb.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=greedy(1),
            target=wpb.KVTarget(transfer_address=res.transfer_address, lease_id="no-such-lease",
                                dst_block_ids=res.block_ids, first_block=0, transport="shm",
                                transfer_instance=res.transfer_instance)), timeout=60)


def traffic(stack, stop: threading.Event) -> None:
    stub = stack.generation()
    while not stop.is_set():
        run(stub, pb.GenerateRequest(text=COPY, sampling=greedy(24)))
        with pytest.raises(grpc.RpcError):  # rejected: invalid_argument
            run(stub, pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(
                max_tokens=4, temperature=-1.0)))
        call = stub.Generate(pb.GenerateRequest(text="Count to a thousand:",
                                                sampling=greedy(200, ignore_eos=True)),
                             timeout=60)
        next(call)
        call.cancel()  # aborted: client_disconnected


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", ()))]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", ())]


def test_every_dashboard_query_returns_data_from_a_real_prometheus(stack, prometheus):
    stop = threading.Event()
    refuse_a_transfer(stack)
    worker = threading.Thread(target=traffic, args=(stack, stop), daemon=True)
    worker.start()
    try:
        time.sleep(TRAFFIC_S)
        # the dashboard's variable: label_values(pdserve:num_requests_running, model_name)
        r = httpx.get(f"{prometheus}/api/v1/label/model_name/values",
                      params={"match[]": "pdserve:num_requests_running"}, timeout=10).json()
        assert r["data"] == [MODEL], r
        queries = dashboard_queries()
        assert len(queries) >= 40
        empty = []
        for title, expr in queries:
            promql = expr.replace("$__rate_interval", RATE_INTERVAL).replace(
                "$model_name", MODEL)
            result = query(prometheus, promql)
            values = [float(s["value"][1]) for s in result]
            if not any(math.isfinite(v) for v in values):
                empty.append((title, promql, values))
        targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]
        health = [(t["labels"]["job"], t["health"], t["lastError"])
                  for t in targets["activeTargets"]]
        assert not empty, (f"panel queries without data (scrape targets: {health}):\n"
                           + "\n".join(map(str, empty)))
    finally:
        stop.set()
        worker.join(60)
    stack.wait_idle()


def test_the_slo_rules_evaluate_on_the_live_series(prometheus):
    """Every rule loaded and evaluated without error; the recording rules have data (the test
    above ran traffic within their 5 minute window)."""
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in slo_rule_groups())
    wait_until(lambda: all(r.get("lastEvaluation", "").startswith("2") for r in rules), 10,
               "every rule evaluated")
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    for r in rules:
        if r["type"] == "recording":
            result = query(prometheus, r["name"])
            assert result and all(math.isfinite(float(s["value"][1])) for s in result), r
