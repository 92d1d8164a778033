"""A real `pdserve gateway --colocated` process on loopback (the real model, float32), shared by
every gateway test so the model loads once; the offline engine loads meanwhile."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"pdserve gateway: gRPC (\S+)\s+HTTP (\S+)")
STARTUP_TIMEOUT_S = 180  # the model loads in ~10 s alone; 2 shared cores can be much slower


@dataclass
class Gateway:
    proc: subprocess.Popen
    log: Path
    grpc_addr: str
    http_url: str

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.grpc_addr)

    def stub(self, channel: grpc.Channel) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(channel)

    def status(self) -> dict:
        return httpx.get(f"{self.http_url}/internal/status", timeout=10).json()

    def wait_idle(self, timeout_s: float = 15.0) -> dict:
        """Wait until nothing runs or waits and every KV block is free; return the status."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.status()
            if (s["num_running"] == s["num_waiting"] == s["num_streams"] == 0
                    and s["num_free_blocks"] == s["num_blocks"]):
                assert s["kv_integrity"] == "ok", s
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway did not get idle: {s}")
            time.sleep(0.05)


def spawn_gateway(*extra: str) -> tuple[subprocess.Popen, Path]:
    log = Path(tempfile.mkstemp(prefix="pdserve-gateway-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "pdserve", "--log-level", "WARNING", "gateway", "--colocated",
           "--dtype", "float32", "--port", "0", "--http-port", "0",
           "--kv-cache-memory-gb", "0.5", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, log


def wait_ready(proc: subprocess.Popen, log: Path) -> Gateway:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        match = READY.search(log.read_text())
        if match:
            return Gateway(proc, log, match.group(1), match.group(2))
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the gateway did not start:\n{log.read_text()[-4000:]}")


def stop_gateway(gw: Gateway, timeout_s: float = 30.0) -> int:
    """SIGTERM, then the exit code (killed if it does not stop in time)."""
    if gw.proc.poll() is None:
        gw.proc.send_signal(signal.SIGTERM)
    try:
        return gw.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        gw.proc.kill()
        gw.proc.wait()
        raise


def pytest_collection_modifyitems(config, items):
    """The shutdown test stops the shared gateway: run it after every other test."""
    last = [item for item in items if item.originalname == "test_sigterm_drains_then_exits"]
    items[:] = [item for item in items if item not in last] + last


class Offline:
    """Greedy references from the offline engine, each computed once per session."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._cache: dict = {}

    def generate(self, prompt: str, max_tokens: int):
        """RequestOutput of LLM.generate(prompt), greedy."""
        from engine_core.sampling_params import SamplingParams

        key = ("generate", prompt, max_tokens)
        if key not in self._cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            self._cache[key] = self.llm.generate(prompt, params)[0]
        return self._cache[key]

    def chat(self, conv: list[dict[str, str]], max_tokens: int):
        """RequestOutput of LLM.chat(conv), greedy."""
        from engine_core.sampling_params import SamplingParams

        key = ("chat", repr(conv), max_tokens)
        if key not in self._cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            self._cache[key] = self.llm.chat(conv, params)[0]
        return self._cache[key]


@pytest.fixture(scope="session")
def offline(model_path):
    """The offline engine, LLM(dtype="float32") with the engine's default settings like the
    gateway's engine (the shared llm_fp32 fixture turns quantized decode off)."""
    from engine_core.llm import LLM

    return Offline(LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25))


@pytest.fixture(scope="session")
def gateway(request, model_path):
    # NOT_SERVING for 2 s before the listeners close, so the shutdown test can observe it
    proc, log = spawn_gateway("--shutdown-delay", "2", "--grace", "20")
    request.getfixturevalue("offline")  # load the offline engine while the gateway loads
    gw = wait_ready(proc, log)
    yield gw
    assert stop_gateway(gw) == 0, gw.log.read_text()[-4000:]
    gw.log.unlink(missing_ok=True)
