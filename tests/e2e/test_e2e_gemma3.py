"""Gemma 3 270M (Q4_K_M) served by `pdserve up --model gemma3-270m` on the defaults a user gets
(bf16, int8 decode activations where the CPU has VNNI): greedy output equal to the offline
engine's on the same defaults, over shm (the stack's transport) and over grpc (a second
gateway in front of the same workers, `--transport grpc`), with a prompt longer than the
512-token sliding window; and the base model's missing chat template as a clear 400.

One stack, so the model loads in three processes once; the offline engine loads meanwhile."""

from __future__ import annotations

import re

import httpx2 as httpx
import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    LONG,
    Stack,
    greedy,
    out_ids,
    run,
    spawn_stack,
    stop_stack,
    wait_stack,
)
from tests.helpers import (
    kill_tree,
    log_tail,
    spawn_pdserve,
    stop_process,
    torch_threads,
    wait_for_output,
)

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
N = 12  # tokens per greedy comparison
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           " ".join([LONG] * 12)]  # ~620 tokens: across the 512-token window
GATEWAY_READY = re.compile(r"pdserve gateway: gRPC (\S+)\s+HTTP (\S+)")


@pytest.fixture(scope="module")
def gemma():
    """The offline engine on the defaults, as the stack's workers run them."""
    from engine_core.llm import LLM

    return LLM(MODEL, kv_cache_memory_gb=0.25)


@pytest.fixture(scope="module")
def stack(request) -> Stack:
    proc, log = spawn_stack("--model", MODEL, "--transport", "shm")
    try:
        request.getfixturevalue("gemma")  # loads while the stack loads
        s = wait_stack(proc, log)
    except BaseException:
        kill_tree(proc)
        raise
    yield s
    code = stop_stack(s)
    text = log_tail(s.log, 10**7)
    assert code == 0 and "Traceback" not in text, text[-4000:]


@pytest.fixture(scope="module")
def grpc_gateway(stack: Stack):
    """A second gateway in front of the stack's workers that moves the KV over grpc."""
    proc, log = spawn_pdserve("--log-level", "WARNING", "gateway", "--model", MODEL,
                              "--prefill", *stack.prefill, "--decode", *stack.decode,
                              "--transport", "grpc", "--port", "0", "--http-port", "0",
                              name="gateway-grpc")
    try:
        m = wait_for_output(proc, log, GATEWAY_READY, 300, "the grpc gateway")
    except BaseException:
        kill_tree(proc)
        raise
    yield m.group(1)
    assert stop_process(proc, 30) == 0, log_tail(log)


def reference(llm, prompt: str) -> list[int]:
    from engine_core.sampling_params import SamplingParams

    with torch_threads(1):  # each worker runs one thread on its pinned core
        out = llm.generate(prompt, SamplingParams(max_tokens=N, temperature=0.0))[0]
    return out.outputs[0].token_ids


def test_greedy_equals_offline_over_shm_and_grpc(stack, grpc_gateway, gemma):
    import grpc

    from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(grpc_gateway) as channel:
        over_grpc = pb_grpc.GenerationStub(channel)
        for prompt in PROMPTS:
            expected = reference(gemma, prompt)
            for transport, stub in (("shm", stack.generation()), ("grpc", over_grpc)):
                msgs = run(stub, pb.GenerateRequest(text=prompt, sampling=greedy(N)))
                assert out_ids(msgs) == expected, (transport, len(prompt))
    assert len(gemma.tokenizer.encode(PROMPTS[-1])) > 512
    stack.wait_idle()


def test_chat_without_a_template_is_a_clear_400(stack):
    resp = httpx.post(f"{stack.http_url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert resp.status_code == 400, resp.text
    assert "has no chat template" in resp.json()["error"]["message"]
