"""A disaggregated cluster as separate processes on fixed loopback ports, for fault tests:
2 prefill + 2 decode workers (real model, float32, one thread each) and a gateway given their
static addresses. Workers can be killed and started again at the same address. Each process
logs to a temporary file, deleted at the end unless PDSERVE_TEST_KEEP_LOGS is set (the paths
are then printed: run pytest with -s)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import grpc
import httpx2 as httpx

from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.internal import workers_pb2_grpc as wpb_grpc
from tests.e2e.stack import is_idle, out_ids
from tests.helpers import kill_tree, spawn_pdserve, wait_for_output, wait_until

STARTUP_TIMEOUT_S = 300
WORKER_READY = re.compile(r"READY (prefill|decode) (\S+)")
GATEWAY_READY = re.compile(r"pdserve gateway: gRPC (\S+)\s+HTTP (\S+)")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the offline reference runs one thread too
LEASE_TTL_S = 6.0  # short: the gateway checks a stalled prefill worker every 2 s


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
            "--http-port", "0", "--transport", "shm", "--lease-ttl", str(LEASE_TTL_S),
            "--canary-idle-s", "0", name="gateway")  # no synthetic traffic: see stack.py

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
        for name, (_, log) in self.procs.items():
            if os.environ.get("PDSERVE_TEST_KEEP_LOGS"):
                print(f"{name} log kept: {log}")
            else:
                log.unlink(missing_ok=True)


def assert_greedy_unchanged(ref, prompts: list[str], results, max_tokens: int) -> None:
    """Every request's greedy tokens equal the offline engine's, after whatever fault: re-runs
    join other batches on other workers, which must not change a token. (This once failed at
    a 12th token: bf16 decode logits tied exactly, 0.125 apart, and the tie went either way
    with the batch; see decode_quant.DecodeQuantLMHead and cpu_attention._decode.)"""
    mismatches = [(p[:9], out_ids(m), ref.generate(p, max_tokens).outputs[0].token_ids)
                  for p, m in zip(prompts, results, strict=True)
                  if out_ids(m) != ref.generate(p, max_tokens).outputs[0].token_ids]
    assert not mismatches, f"greedy output changed (prompt, got, offline): {mismatches}"
