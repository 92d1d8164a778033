"""A real `pdserve gateway --colocated` process on loopback (the real model, float32), shared by
every gateway test so the model loads once; the offline engine loads meanwhile."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx
import openai
import pytest

from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.helpers import spawn_pdserve, stop_process, wait_for_output

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
    return spawn_pdserve("--log-level", "WARNING", "gateway", "--colocated", "--dtype",
                         "float32", "--port", "0", "--http-port", "0", "--kv-cache-memory-gb",
                         "0.5", *extra, name="gateway")


def wait_ready(proc: subprocess.Popen, log: Path) -> Gateway:
    try:
        match = wait_for_output(proc, log, READY, STARTUP_TIMEOUT_S, "the gateway")
    except RuntimeError:
        proc.kill()
        proc.wait()
        raise
    return Gateway(proc, log, match.group(1), match.group(2))


def stop_gateway(gw: Gateway, timeout_s: float = 30.0) -> int:
    """SIGTERM, then the exit code (killed if it does not stop in time)."""
    return stop_process(gw.proc, timeout_s)


def pytest_collection_modifyitems(config, items):
    """The shutdown test stops the shared gateway: run it after every other test."""
    last = [item for item in items if item.originalname == "test_sigterm_drains_then_exits"]
    items[:] = [item for item in items if item not in last] + last


@pytest.fixture(scope="session")
def gateway(request, model_path):
    # NOT_SERVING for 2 s before the listeners close, so the shutdown test can observe it
    proc, log = spawn_gateway("--shutdown-delay", "2", "--grace", "20")
    request.getfixturevalue("offline")  # load the offline engine while the gateway loads
    gw = wait_ready(proc, log)
    yield gw
    assert stop_gateway(gw) == 0, gw.log.read_text()[-4000:]
    gw.log.unlink(missing_ok=True)


# -- gateways serving the real model with a thinking template (--reasoning-parser auto picks by
# what the template writes), shared by the HTTP and gRPC reasoning tests ----------------------
# a Qwen3-like template: thinking unless enable_thinking is false (then an empty think block,
# as Qwen3's); `open_thinking` ends the prompt inside <think>, as DeepSeek-R1's does
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_thinking %}<think>\n{% endif %}{% endif %}")
HARMONY_TEMPLATE = (  # GPT-OSS's system line takes reasoning_effort
    "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: "
    "{{ reasoning_effort }}<|end|>{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>"
    "{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def openai_client(gw: Gateway):
    """The official client on gw's HTTP API (a generator: a fixture yields from it)."""
    with openai.OpenAI(base_url=f"{gw.http_url}/v1", api_key="unused", timeout=180,
                       max_retries=0) as c:
        yield c


def template_gateway(tmp_path_factory, name: str, template: str):
    """A real gateway serving the model with `template` (so --reasoning-parser auto picks by
    it), stopped at the end."""
    path = tmp_path_factory.mktemp(name) / "template.jinja"
    path.write_text(template)
    proc, log = spawn_gateway("--chat-template", str(path))
    gw = wait_ready(proc, log)
    yield gw
    assert stop_gateway(gw) == 0, gw.log.read_text()[-4000:]
    gw.log.unlink(missing_ok=True)


@pytest.fixture(scope="package")
def thinking_gateway(tmp_path_factory, model_path):
    """Its template writes <think>: the think parser."""
    yield from template_gateway(tmp_path_factory, "reasoning", TEMPLATE)


@pytest.fixture(scope="package")
def seed_gateway(tmp_path_factory, model_path):
    """Its template writes Seed-OSS's <seed:think>: the seed_oss parser."""
    yield from template_gateway(tmp_path_factory, "seed", TEMPLATE.replace("think>",
                                                                           "seed:think>"))


@pytest.fixture(scope="package")
def harmony_gateway(tmp_path_factory, model_path):
    """Its template writes harmony's <|channel|> (GPT-OSS's): the harmony parser."""
    yield from template_gateway(tmp_path_factory, "harmony", HARMONY_TEMPLATE)
