"""Traces across the three processes: a cluster of a gateway, a prefill and a decode host, each
started with --otlp-traces-endpoint pointing at an OTLP/gRPC receiver in the test process
(opentelemetry-proto's TraceService, served by grpcio). One request's spans, from all three
processes, share one trace id, and each process's spans hang where they belong: the worker
calls under the gateway's request span, each worker's server span under the gateway's call,
the phases under their process's span. Each process's resource names its role and worker."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc

from tests.cluster.cluster_checks import generate
from tests.helpers import wait_until
from tests.redis_server import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


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
    endpoint = ("--otlp-traces-endpoint", f"http://{{root_ip}}:{receiver[1]}")
    return cluster_factory(num_prefill=1, num_decode=1, worker_args=endpoint,
                           gateway_args=("--canary-idle-s", "0", *endpoint))


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
    names = {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}

    def complete():
        got = spans.of_trace(request.trace_id)
        return got if {n for n, _, _ in got} == names and len(got) >= 14 else None

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
    for service, method, worker in (
            ("pdserve-decode", "pdserve.internal.Decode/Reserve", "decode-0"),
            ("pdserve-prefill", "pdserve.internal.Prefill/Prefill", "prefill-0"),
            ("pdserve-decode", "pdserve.internal.Decode/Decode", "decode-0")):
        _, client = one("pdserve-gateway", method)
        instance, server = one(service, method)
        assert client.parent_span_id == request.span_id, method
        assert server.parent_span_id == client.span_id, method
        assert instance == worker
        assert client.kind == 3 and server.kind == 2  # SPAN_KIND_CLIENT, SPAN_KIND_SERVER
    _, prefill_call = one("pdserve-prefill", "pdserve.internal.Prefill/Prefill")
    for phase in ("queue", "prefill", "kv_transfer"):
        assert one("pdserve-prefill", phase)[1].parent_span_id == prefill_call.span_id, phase
