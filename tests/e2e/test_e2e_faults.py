"""Worker faults under load, with real processes and the real model: 2 prefill + 2 decode
workers and a gateway with static addresses (what a deployment without Redis runs).

1. a prefill worker frozen (SIGSTOP) with prompts on it: they run on the other one.
2. kill -9 of a prefill worker with prompts on it: they are prefilled again on the other one;
   every request completes with the offline engine's greedy output.
3. kill -9 of a decode worker with streams on it: they continue on the other decode worker
   (re-prefilled with the tokens already streamed); every stream gets all its tokens, each
   stretch equal to the offline engine's greedy continuation of the prompt + the tokens
   streamed before it.
4. no decode worker left: a request fails fast with UNAVAILABLE.
5. a decode worker restarts at its old address: the gateway uses it again, no restart.
6. SIGTERM to a decode worker under a stream: it drains the stream, then exits 0.
After each fault the surviving workers' pools are full and nothing runs.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.cluster import assert_greedy_unchanged
from tests.e2e.stack import LONG, check_continuation, greedy, out_ids, resume_points, run
from tests.helpers import log_tail, wait_until

pytestmark = pytest.mark.slow

PROMPTS = [f"Story {i}. {LONG}" for i in range(6)]  # distinct first blocks
LONG_PROMPTS = [f"Chapter {i}. {LONG * 6}" for i in range(6)]


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.grpc_addr) as channel:
        yield pb_grpc.GenerationStub(channel)


def run_all(stub, max_tokens: int, when_started,
            prompts: list[str] = PROMPTS) -> list[list[pb.GenerateResponse]]:
    """The prompts at once (greedy, max_tokens each, no early EOS, request ids
    fault-<max_tokens>-<i>); `when_started()` runs while they are in flight."""
    def one(i: int):
        return run(stub, pb.GenerateRequest(
            text=prompts[i], request_id=f"fault-{max_tokens}-{i}",
            sampling=greedy(max_tokens, ignore_eos=True)), timeout=300)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        when_started()
        return [f.result() for f in futures]


def migrations(cluster, pool: str) -> float:
    """Requests the gateway ran again after losing a `pool` worker: its Prometheus counter
    pdserve:request_migrations_total{pool}, which /internal/status agrees with."""
    text = httpx.get(f"{cluster.http_url}/metrics", timeout=10).text
    counted = sum(s.value for f in text_string_to_metric_families(text)
                  if f.name == "pdserve:request_migrations" for s in f.samples
                  if s.name.endswith("_total") and s.labels.get("pool") == pool)
    assert counted == cluster.status()["migrations"][pool]
    return counted


def test_stalled_prefill_worker_requests_rerun_elsewhere(cluster, stub, ref_fp32):
    """SIGSTOP freezes prefill-1 with prompts on it (its connections stay open, so nothing
    fails by itself): the gateway sees its Status time out, gives up on its calls and runs
    them on prefill-0; all complete with the greedy output. Resumed, prefill-1 ends idle."""
    before = migrations(cluster, "prefill")
    proc, _ = cluster.procs["prefill-1"]

    def stop_when_busy():
        wait_until(lambda: cluster.in_flight("prefill-1") > 0, 60, "prefill-1 busy",
                   interval_s=0.01)
        proc.send_signal(signal.SIGSTOP)

    try:  # long prompts (~330 tokens): prefill-1 stays busy long enough to be caught
        results = run_all(stub, 4, stop_when_busy, LONG_PROMPTS)
    finally:
        proc.send_signal(signal.SIGCONT)
    for prompt, msgs in zip(LONG_PROMPTS, results, strict=True):
        assert out_ids(msgs) == ref_fp32.generate(prompt, 4).outputs[0].token_ids
    assert migrations(cluster, "prefill") > before
    cluster.wait_idle()


def test_prefill_worker_killed_requests_rerun_unchanged(cluster, stub, ref_fp32):
    before = migrations(cluster, "prefill")

    def kill_when_busy():
        wait_until(lambda: cluster.in_flight("prefill-0") > 0, 60, "prefill-0 busy")
        cluster.kill("prefill-0")

    results = run_all(stub, 12, kill_when_busy)
    for msgs in results:  # every request completed, every token once
        assert len(out_ids(msgs)) == msgs[-1].usage.completion_tokens == 12
    assert migrations(cluster, "prefill") > before  # some requests did run again
    cluster.wait_idle()
    assert_greedy_unchanged(ref_fp32, PROMPTS, results, 12)


def test_decode_worker_killed_streams_continue(cluster, stub, ref_fp32):
    before = migrations(cluster, "decode")
    n = 160  # long enough that decode-0 is still streaming when killed (~5 ms per token)

    def kill_when_streaming():
        wait_until(lambda: cluster.worker_status("decode-0").num_running > 0, 60,
                   "decode-0 streaming")
        time.sleep(0.2)  # some tokens out
        cluster.kill("decode-0")

    results = run_all(stub, n, kill_when_streaming)
    points = resume_points(log_tail(cluster.procs["gateway"][1], 10**7))
    resumed = 0
    for i, (prompt, msgs) in enumerate(zip(PROMPTS, results, strict=True)):
        got = out_ids(msgs)
        assert len(got) == msgs[-1].usage.completion_tokens == n  # every token, once
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        at = points.get(f"fault-{n}-{i}", [])
        resumed += bool(at)
        check_continuation(ref_fp32, prompt, got, at)  # token for token, every stretch
    assert resumed > 0 and migrations(cluster, "decode") > before
    cluster.wait_idle()


def test_no_decode_worker_left_fails_fast(cluster, stub):
    cluster.kill("decode-1")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        run(stub, pb.GenerateRequest(text="Hello", sampling=greedy(4)), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert time.monotonic() - t0 < 10


def test_restarted_decode_worker_is_used_again(cluster, stub, ref_fp32):
    cluster.spawn_worker("decode-0")  # the same address as the worker killed above
    cluster.wait_worker("decode-0")
    prompt = PROMPTS[0]

    def serves():
        try:
            return run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(8)), timeout=60)
        except grpc.RpcError:
            return None

    msgs = wait_until(serves, 30, "the gateway serving through the restarted decode worker",
                      interval_s=0.5)
    assert out_ids(msgs) == ref_fp32.generate(prompt, 8).outputs[0].token_ids
    cluster.wait_idle()


def test_sigterm_drains_a_decode_worker_then_it_exits(cluster, stub, ref_fp32):
    """Graceful shutdown: SIGTERM to the decode worker under a stream. It stops serving (health
    NOT_SERVING, then new calls refused), the stream still gets every token (drained within
    --grace), and the process exits 0."""
    prompt = PROMPTS[1]
    proc, _ = cluster.procs["decode-0"]
    call = stub.Generate(pb.GenerateRequest(text=prompt, sampling=greedy(24, ignore_eos=True)),
                         timeout=120)
    first = next(call)
    proc.send_signal(signal.SIGTERM)
    with grpc.insecure_channel(cluster.address("decode-0")) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        wait_until(lambda: not _serving(health), 10, "decode-0 to stop serving")
    msgs = [first, *call]
    assert out_ids(msgs) == ref_fp32.generate(prompt, 24).outputs[0].token_ids
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert proc.wait(timeout=30) == 0
    cluster.procs.pop("decode-0")
    cluster.wait_idle()  # the prefill pool too


def _serving(health) -> bool:
    try:
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError:
        return False  # the server no longer accepts calls
    return status == health_pb2.HealthCheckResponse.SERVING
