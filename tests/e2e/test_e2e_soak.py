"""A bounded soak through the full stack (2 prefill + 2 decode workers, a gateway; real
processes, the real model): many short requests at once while a decode worker is killed and
started again midway. Every outcome is counted and reported, and every request must
complete; the pools end full. CI runs a short form; the full soak is

    PDSERVE_SOAK_REQUESTS=2000 PDSERVE_SOAK_CONCURRENCY=64 python -m pytest tests/e2e/test_e2e_soak.py -s
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.cluster import assert_greedy_unchanged
from tests.e2e.stack import LONG, greedy, out_ids, run
from tests.helpers import log_tail, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.grpc_addr) as channel:
        yield pb_grpc.GenerationStub(channel)


SOAK_REQUESTS = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "120"))
SOAK_CONCURRENCY = int(os.environ.get("PDSERVE_SOAK_CONCURRENCY", "32"))
CLEAR_ERRORS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED)


def test_soak_with_a_decode_worker_restarted_midway(cluster, stub):
    """SOAK_REQUESTS short requests at SOAK_CONCURRENCY (the full soak: PDSERVE_SOAK_REQUESTS
    =2000 PDSERVE_SOAK_CONCURRENCY=64); halfway, decode-1 is killed and started again. Every
    outcome is counted and printed; every request completes (a clear error status is still
    a failure here: a decode worker was left throughout); pools end full."""
    outcomes: dict[str, int] = {}
    failures: list[str] = []  # each failed request's status and details, for the report
    done = 0

    def one(i: int) -> str:
        nonlocal done
        try:
            msgs = run(stub, pb.GenerateRequest(text=f"Note {i}: the weather today is",
                                                sampling=greedy(8, ignore_eos=True)),
                       timeout=300)
            ok = msgs[-1].usage.completion_tokens == len(out_ids(msgs)) == 8
            return "completed" if ok else "wrong length"
        except grpc.RpcError as e:
            failures.append(f"request {i}: {e.code().name}: {e.details()}")
            is_clear = e.code() in CLEAR_ERRORS and bool(e.details())
            return f"{e.code().name}" if is_clear else f"unclear {e.code().name}"
        finally:
            done += 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(SOAK_CONCURRENCY) as pool:
        futures = [pool.submit(one, i) for i in range(SOAK_REQUESTS)]
        wait_until(lambda: done >= SOAK_REQUESTS // 2, 600, "half the soak")
        cluster.kill("decode-1")
        cluster.spawn_worker("decode-1")
        results = [f.result(timeout=600) for f in futures]
    for r in results:
        outcomes[r] = outcomes.get(r, 0) + 1
    elapsed = time.monotonic() - t0
    print(f"soak: {SOAK_REQUESTS} requests at concurrency {SOAK_CONCURRENCY} in {elapsed:.0f} s "
          f"({SOAK_REQUESTS / elapsed:.1f} req/s), decode-1 restarted midway: {outcomes}; "
          f"migrations {cluster.status()['migrations']}")
    cluster.wait_worker("decode-1")  # first: a failed assertion must not leave it starting
    assert sum(outcomes.values()) == SOAK_REQUESTS  # every request accounted for
    assert not [r for r in outcomes if r.startswith(("unclear", "wrong"))], outcomes
    # decode-0 lives throughout and decode-1 comes back: the gateway migrates what the kill
    # interrupted, so every request completes; a failure, even with a clear status, is a bug
    assert outcomes == {"completed": SOAK_REQUESTS}, (outcomes, failures, retries(cluster))
    cluster.wait_idle()


def retries(cluster) -> list[str]:
    """The gateway's log lines about requests it ran again (what a failed soak reports)."""
    return [line for line in log_tail(cluster.procs["gateway"][1], 10**6).splitlines()
            if "running it again" in line or "lost a worker" in line]


def test_greedy_after_the_soak_matches_offline(cluster, stub, ref_fp32):
    """After the soak and its restart, greedy outputs are still the offline engine's."""
    prompts = [f"Story {i}. {LONG}" for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: run(stub, pb.GenerateRequest(
            text=p, sampling=greedy(12, ignore_eos=True)), timeout=300), prompts))
    cluster.wait_idle()
    for msgs in results:
        assert len(out_ids(msgs)) == msgs[-1].usage.completion_tokens == 12
    assert_greedy_unchanged(ref_fp32, prompts, results, 12)
