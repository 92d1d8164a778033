"""The canary end to end: one `pdserve up --canary-idle-s 1` stack (1 prefill + 1 decode worker,
KV over grpc). While idle the gateway proves the whole path with one-token requests; when the
prefill worker is frozen (SIGSTOP: the process lives and keeps its connections, only the path
is broken), readiness turns NOT_SERVING on gRPC health and HTTP /health/ready within a few
seconds, well before the Status-based stall detection (3 Status timeouts of 5 s), while
liveness stays up; once the worker resumes, readiness comes back and no block is left held.
The same holds when the decode worker is the one frozen: its KV transfer service (which shares
its gRPC port) stops answering while the process lives."""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.stack import Stack
from tests.helpers import log_tail, wait_until

pytestmark = pytest.mark.slow

IDLE_S, TIMEOUT_S = 1.0, 2.0
LOST_WITHIN_S = 8.0  # one idle check + one canary timeout + slack on 2 shared cores
PIDS = re.compile(r"^\s*pids: (.+)$", re.M)


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    start, stop = stack_factory
    s = start("--transport", "grpc", "--canary-idle-s", str(IDLE_S), "--canary-timeout-s",
              str(TIMEOUT_S), "--canary-failures", "3")
    yield s
    stop(s)


def pid_of(stack: Stack, name: str) -> int:
    text = log_tail(stack.log, 10**7)
    return dict((k, int(v)) for k, v in (item.split("=") for item in
                                           PIDS.search(text).group(1).split()))[name]


def grpc_health(stack: Stack) -> int:
    with grpc.insecure_channel(stack.grpc_addr) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status


def http_status(stack: Stack, path: str) -> int:
    return httpx.get(f"{stack.http_url}{path}", timeout=5).status_code


def canary(stack: Stack) -> dict:
    return stack.gateway_status()["canary"]


def test_an_idle_stack_sends_canaries_through_the_whole_path(stack):
    first = wait_until(lambda: canary(stack)["last_success"], 10, "a successful canary")
    later = wait_until(lambda: (canary(stack)["last_success"] or 0) > first and
                       canary(stack)["last_success"], 10, "another canary while idle")
    assert later - first >= IDLE_S * 0.9
    c = canary(stack)
    assert c["enabled"] and c["ready"] and c["bad_pairs"] == [] and c["last_latency_s"] > 0
    text = httpx.get(f"{stack.http_url}/metrics", timeout=5).text
    assert re.search(r"^pdserve:canary_latency_seconds\{[^}]*\} [0-9.e-]+$", text, re.M)
    assert re.search(r"^pdserve:canary_ready\{[^}]*\} 1\.0$", text, re.M)
    # each canary moved KV from the prefill worker to the decode worker
    prefill_metrics = httpx.get(stack.metrics[1], timeout=5).text
    (count,) = re.findall(r'^pdserve:kv_transfer_time_seconds_count\{[^}]*transport="grpc"'
                          r'[^}]*\} ([0-9.]+)$', prefill_metrics, re.M)
    assert float(count) >= 2
    assert grpc_health(stack) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("worker", ["prefill-0", "decode-0"])
def test_a_frozen_worker_turns_readiness_off_and_back_without_leaking(stack, worker):
    pid = pid_of(stack, worker)
    os.kill(pid, signal.SIGSTOP)
    t_frozen = time.monotonic()
    try:
        wait_until(lambda: http_status(stack, "/health/ready") == 503, LOST_WITHIN_S,
                   "readiness lost (HTTP /health/ready 503)")
        lost_after = time.monotonic() - t_frozen
        assert grpc_health(stack) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert http_status(stack, "/health") == 503
        assert http_status(stack, "/health/live") == 200  # liveness stays up
        failures = httpx.get(f"{stack.http_url}/metrics", timeout=5).text
        assert re.search(r'^pdserve:canary_failures_total\{[^}]*reason="timeout"[^}]*\} '
                         r'[1-9]', failures, re.M), failures[-3000:]
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: http_status(stack, "/health/ready") == 200, 20, "readiness restored")
    assert grpc_health(stack) == health_pb2.HealthCheckResponse.SERVING
    assert canary(stack)["ready"] and canary(stack)["bad_pairs"] == []
    assert lost_after < LOST_WITHIN_S
    stack.wait_idle()  # both pools full again: the canaries cut short freed their blocks
