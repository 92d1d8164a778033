"""Worker faults under load, with real processes and the real model: 2 prefill + 2 decode
workers and a gateway with static addresses (what a deployment without Redis runs).

1. kill -9 of a prefill worker with prompts on it: they are prefilled again on the other one;
   every request completes with the offline engine's greedy output.
2. kill -9 of a decode worker with streams on it: they continue on the other decode worker
   (re-prefilled with the tokens already streamed); every stream gets all its tokens.
3. no decode worker left: a request fails fast with UNAVAILABLE.
4. a decode worker restarts at its old address: the gateway uses it again, no restart.
After each fault the surviving workers' pools are full and nothing runs.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.internal import workers_pb2_grpc as wpb_grpc
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.stack import LONG, greedy, is_idle, out_ids, run
from tests.helpers import kill_tree, log_tail, spawn_pdserve, wait_for_output, wait_until

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300
WORKER_READY = re.compile(r"READY (prefill|decode) (\S+)")
GATEWAY_READY = re.compile(r"pdserve gateway: gRPC (\S+)\s+HTTP (\S+)")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the offline reference runs one thread too
PROMPTS = [f"Story {i}. {LONG}" for i in range(6)]  # distinct first blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Workers and a gateway as separate processes, on fixed loopback ports."""

    def __init__(self) -> None:
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.ports = {name: free_port() for name in ("prefill-0", "prefill-1", "decode-0",
                                                     "decode-1")}
        self.grpc_addr = self.http_url = ""

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def spawn_worker(self, name: str) -> None:
        role = name.split("-")[0]
        extra = ["--transports", "grpc,shm"] if role == "decode" else []
        self.procs[name] = spawn_pdserve(role, "--port", str(self.ports[name]), "--dtype",
                                         "float32", "--kv-cache-memory-gb", "0.25", *extra,
                                         name=name, env=ONE_THREAD)

    def wait_worker(self, name: str) -> None:
        wait_for_output(*self.procs[name], WORKER_READY, STARTUP_TIMEOUT_S, name)

    def start(self) -> None:
        for name in self.ports:
            self.spawn_worker(name)
        self.procs["gateway"] = spawn_pdserve(
            "gateway", "--prefill", self.address("prefill-0"), self.address("prefill-1"),
            "--decode", self.address("decode-0"), self.address("decode-1"), "--port", "0",
            "--http-port", "0", "--transport", "shm", name="gateway")

    def wait_gateway(self) -> None:
        for name in self.ports:
            self.wait_worker(name)
        m = wait_for_output(*self.procs["gateway"], GATEWAY_READY, STARTUP_TIMEOUT_S,
                            "gateway")
        self.grpc_addr, self.http_url = m.group(1), m.group(2)

    def kill(self, name: str) -> None:
        proc, _ = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def status(self) -> dict:
        return httpx.get(f"{self.http_url}/internal/status", timeout=10).json()

    def worker_status(self, name: str) -> wpb.WorkerStatus:
        stub_cls = wpb_grpc.PrefillStub if name.startswith("prefill") else wpb_grpc.DecodeStub
        with grpc.insecure_channel(self.address(name)) as ch:
            return stub_cls(ch).Status(wpb.StatusRequest(), timeout=10)

    def wait_idle(self) -> None:
        """The live workers' pools are full and nothing runs, waits or is reserved."""
        live = [n for n in self.ports if n in self.procs]
        wait_until(lambda: all(is_idle(self.worker_status(n)) for n in live), 30,
                   f"workers {live} idle")

    def in_flight(self, name: str) -> int:
        return next(w["in_flight"] for w in self.status()["workers"]
                    if w["address"] == self.address(name))

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            kill_tree(proc)
        for _, log in self.procs.values():
            log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def cluster(request):
    c = Cluster()
    c.start()
    try:
        request.getfixturevalue("ref")  # the offline engine loads while the workers load
        c.wait_gateway()
        yield c
    except BaseException:
        for name, (_proc, log) in c.procs.items():
            print(f"--- {name}\n{log_tail(log)}")
        raise
    finally:
        c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.grpc_addr) as channel:
        yield pb_grpc.GenerationStub(channel)


def run_all(stub, max_tokens: int, when_started) -> list[list[pb.GenerateResponse]]:
    """The prompts at once (greedy, max_tokens each, no early EOS); `when_started()` runs
    while they are in flight."""
    def one(prompt: str):
        return run(stub, pb.GenerateRequest(
            text=prompt, sampling=greedy(max_tokens, ignore_eos=True)), timeout=300)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(one, p) for p in PROMPTS]
        when_started()
        return [f.result() for f in futures]


def migrations(cluster, pool: str) -> int:
    return cluster.status()["migrations"][pool]


def test_prefill_worker_killed_requests_rerun_unchanged(cluster, stub, ref):
    before = migrations(cluster, "prefill")

    def kill_when_busy():
        wait_until(lambda: cluster.in_flight("prefill-0") > 0, 60, "prefill-0 busy")
        cluster.kill("prefill-0")

    results = run_all(stub, 12, kill_when_busy)
    for prompt, msgs in zip(PROMPTS, results, strict=True):
        assert out_ids(msgs) == ref.generate(prompt, 12).outputs[0].token_ids  # greedy kept
    assert migrations(cluster, "prefill") > before  # some requests did run again
    cluster.wait_idle()


def test_decode_worker_killed_streams_continue(cluster, stub, ref):
    before = migrations(cluster, "decode")
    n = 40

    def kill_when_streaming():
        wait_until(lambda: cluster.worker_status("decode-0").num_running > 0, 60,
                   "decode-0 streaming")
        time.sleep(0.5)  # some tokens out
        cluster.kill("decode-0")

    results = run_all(stub, n, kill_when_streaming)
    for prompt, msgs in zip(PROMPTS, results, strict=True):
        got = out_ids(msgs)
        assert len(got) == msgs[-1].usage.completion_tokens == n  # every token, once
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        expected = ref.generate(prompt, n).outputs[0].token_ids
        assert got[:8] == expected[:8]  # at least the start is the unbroken greedy output
    assert migrations(cluster, "decode") > before
    cluster.wait_idle()


def test_no_decode_worker_left_fails_fast(cluster, stub):
    cluster.kill("decode-1")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        run(stub, pb.GenerateRequest(text="Hello", sampling=greedy(4)), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert time.monotonic() - t0 < 10


def test_restarted_decode_worker_is_used_again(cluster, stub, ref):
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
    assert out_ids(msgs) == ref.generate(prompt, 8).outputs[0].token_ids
    cluster.wait_idle()
