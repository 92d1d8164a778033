"""SIGTERM on a busy gateway: health turns NOT_SERVING, the in-flight stream still completes
(drained within the grace period), then the process exits 0. Runs last (see conftest.py): it
stops the shared gateway."""

from __future__ import annotations

import signal
import time

import httpx2 as httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdserve.v1 import generate_pb2 as pb


def test_sigterm_drains_then_exits(gateway):
    with gateway.channel() as channel:
        stub = gateway.stub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        sampling = pb.SamplingParameters(max_tokens=16, temperature=0, ignore_eos=True)
        call = stub.Generate(pb.GenerateRequest(text="Count:", sampling=sampling))
        first = next(call)
        gateway.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while True:  # the shutdown delay keeps the listeners open for 2 s
            status = health.Check(health_pb2.HealthCheckRequest(service="")).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            time.sleep(0.02)
        assert httpx.get(f"{gateway.http_url}/health").status_code == 503
        rest = list(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 16
    assert gateway.proc.wait(30) == 0
    assert "Traceback" not in gateway.log.read_text()
