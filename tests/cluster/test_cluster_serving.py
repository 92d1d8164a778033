"""The cluster serves across hosts: Redis, the gateway, a prefill worker and two decode workers
each on a host of its own, found through Redis. Greedy output equals the offline engine's;
`auto` picks grpc between hosts; between a prefill and a decode host that share a machine id
but not /dev/shm (two pods of one node) it picks shm by the ids, cannot map the pool and falls
back to grpc, which the prefill worker logs and exports in pdserve:kv_transport_info.

The cluster also traces (--otlp-traces-endpoint on every process, to an OTLP/gRPC receiver in
the test process: opentelemetry-proto's TraceService served by grpcio): one request's spans,
from all three processes, share one trace id, and each process's spans hang where they
belong: the worker calls under the gateway's request span, each worker's server span under
the gateway's call, the phases under their process's span. Each process's resource names its
role and worker."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc

from tests.cluster.cluster_checks import Load, check_quiescent, generate, sample_value, scrape
from tests.helpers import wait_until
from tests.redis_server import free_port

pytestmark = pytest.mark.cluster

PROMPTS = [[3 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(8)]  # 5..26 tokens
MAX_TOKENS = 24


class Receiver(tpb_grpc.TraceServiceServicer):
    """Every span exported to it: (service.name, service.instance.id, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the service's name)
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans += [(attrs.get("service.name"), attrs.get("service.instance.id"),
                                    s) for s in ss.spans]
        return tpb.ExportTraceServiceResponse()

    def of_trace(self, trace_id: bytes) -> list:
        with self._lock:
            return [x for x in self.spans if x[2].trace_id == trace_id]


@pytest.fixture(scope="module")
def receiver():
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = Receiver()
    tpb_grpc.add_TraceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"0.0.0.0:{port}")  # the hosts reach it over the bridge
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture(scope="module")
def cluster(cluster_factory, receiver):
    # decode-1 shares prefill-0's machine id: pods of one node, each with its own /dev/shm
    endpoint = ("--otlp-traces-endpoint", f"http://{{root_ip}}:{receiver[1]}")
    return cluster_factory(num_prefill=1, num_decode=2, same_node=(("prefill-0", "decode-1"),),
                           worker_args=endpoint, gateway_args=("--canary-idle-s", "0", *endpoint))




def test_greedy_output_across_hosts_equals_offline(cluster, tiny_offline):
    load = Load(cluster, PROMPTS, MAX_TOKENS, concurrency=8, timeout_s=60)
    results = load.results(90)
    assert [r.code for r in results] == [None] * len(PROMPTS), [r.details for r in results]
    for r in results:
        expected = tiny_offline.generate(r.prompt, MAX_TOKENS, ignore_eos=True)
        assert r.token_ids == expected.outputs[0].token_ids, r.prompt
    claimed = {w.name: sample_value(w.metrics_url, "pdserve:kv_leases_ended_total",
                                    state="CLAIMED") for w in cluster.live("decode")}
    assert sum(claimed.values()) == len(PROMPTS) and all(claimed.values()), claimed
    check_quiescent(cluster)


def test_auto_picks_grpc_across_hosts_and_falls_back_from_shm_on_one_node(cluster):
    """Both pairs carried KV in the test above (every decode worker claimed some)."""
    prefill = cluster.workers["prefill-0"]
    pairs = {s.labels["decode"]: s.labels for s in scrape(prefill.metrics_url)
             if s.name == "pdserve:kv_transport_info" and s.value == 1}
    other, same_node = cluster.workers["decode-0"], cluster.workers["decode-1"]
    assert set(pairs) == {other.address, same_node.address}, pairs
    assert other.host.machine_id != prefill.host.machine_id == same_node.host.machine_id
    assert {k: pairs[other.address][k] for k in ("transport", "control", "fallback_from")} == \
        {"transport": "grpc", "control": "grpc", "fallback_from": ""}
    assert {k: pairs[same_node.address][k] for k in ("transport", "control",
                                                     "fallback_from")} == \
        {"transport": "grpc", "control": "grpc", "fallback_from": "shm"}
    assert all(p["prefill"] == "prefill-0" for p in pairs.values())
    log = prefill.proc.log.read_text()
    assert (f"kv transfer to {same_node.address}: shm cannot map the receiver's pool here"
            in log), log[-3000:]
    assert f"kv transfer to {other.address}: shm cannot" not in log


def test_one_requests_spans_from_the_three_processes_share_its_trace(cluster, receiver):
    spans, _ = receiver
    out = generate(cluster.grpc_addr, [3, 4, 5, 6, 7, 8, 9, 10], 8, 60)
    assert out.code is None, out.details

    def root():
        return next((s for name, _, s in list(spans.spans) if name == "pdserve-gateway"
                     and s.name == "pdserve.request" and any(
                         a.key == "pdserve.request_id" and a.value.string_value == out.req_id
                         for a in s.attributes)), None)

    request = wait_until(root, 20, "the gateway's request span")
    calls = [("pdserve-decode", "pdserve.internal.Decode/Reserve", "decode"),
             ("pdserve-prefill", "pdserve.internal.Prefill/Prefill", "prefill-0"),
             ("pdserve-decode", "pdserve.internal.Decode/Decode", "decode")]
    expected = {("pdserve-gateway", n) for n in (
        "pdserve.request", "queue", "prefill", "kv_transfer", "first_decode_step", "stream",
        *(m for _, m, _ in calls))}
    expected |= {(s, m) for s, m, _ in calls}
    expected |= {("pdserve-prefill", n) for n in ("queue", "prefill", "kv_transfer")}
    expected |= {("pdserve-decode", n) for n in ("claim", "first_decode_step", "stream")}

    def complete():  # (the processes export in batches, each in its own time)
        got = spans.of_trace(request.trace_id)
        return got if expected <= {(n, s.name) for n, _, s in got} else None

    got = wait_until(complete, 20, "spans of the three processes in the request's trace")
    by_name = defaultdict(list)
    for service, instance, s in got:
        by_name[(service, s.name)].append((instance, s))

    def one(service: str, name: str):
        (item,) = by_name[(service, name)]
        return item

    gw_instance, _ = one("pdserve-gateway", "pdserve.request")
    assert gw_instance.startswith("gateway-")  # the host's name and the process id
    for phase in ("queue", "prefill", "kv_transfer", "first_decode_step", "stream"):
        assert one("pdserve-gateway", phase)[1].parent_span_id == request.span_id, phase
    # each worker call: a CLIENT span under the request, the worker's SERVER span under it
    for service, method, worker in calls:
        _, client = one("pdserve-gateway", method)
        instance, server = one(service, method)
        assert client.parent_span_id == request.span_id, method
        assert server.parent_span_id == client.span_id, method
        assert instance == worker or (worker == "decode" and instance in ("decode-0",
                                                                          "decode-1"))
        assert client.kind == 3 and server.kind == 2  # SPAN_KIND_CLIENT, SPAN_KIND_SERVER
    _, prefill_call = one("pdserve-prefill", "pdserve.internal.Prefill/Prefill")
    for phase in ("queue", "prefill", "kv_transfer"):
        assert one("pdserve-prefill", phase)[1].parent_span_id == prefill_call.span_id, phase
    # the decode worker's phases, under its span of the request's start on the output stream
    _, decode_call = one("pdserve-decode", "pdserve.internal.Decode/Decode")
    for phase in ("claim", "first_decode_step", "stream"):
        assert one("pdserve-decode", phase)[1].parent_span_id == decode_call.span_id, phase
