"""End-to-end helpers: whole `pdserve up` stacks (gateway + prefill + decode workers as separate
processes on loopback, the real default model on the settings a user gets: dtype "auto", bf16
prefill and int8 decode activations on a CPU that has them), and the checks every end-to-end
module shares.

    stack = wait_stack(*spawn_stack("--transport", "shm"))   # once `pdserve up` is ready
    stack.generation()                   # pdserve.v1.Generation stub on the gateway
    stack.status_all()                   # {address: WorkerStatus} from every worker
    stack.wait_idle()                    # both pools back to full, nothing running
    assert stop_stack(stack) == 0        # SIGTERM: the gateway drains, then the workers stop

Model loading takes ~15-25 s per process here, so each module starts one stack and shares it
(module scope, through the stack_factory fixture of conftest.py); two stacks serve two modules
each (session scope: conftest.py spec_stack and shm_stack).
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx2 as httpx
import torch

from engine_core.config import dtype_name
from engine_core.platforms import resolve_dtype
from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.internal import workers_pb2_grpc as wpb_grpc
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.helpers import (
    kill_tree,
    spawn_pdserve,
    stop_process,
    torch_threads,
    wait_for_output,
)

STARTUP_TIMEOUT_S = 300  # up to 5 processes load the model at once on 2 shared cores
STOP_TIMEOUT_S = 60  # `pdserve up` stops the gateway (it drains), then each worker
IDLE_TIMEOUT_S = 20
MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the default KV block size (tokens)
UP_READY = re.compile(r"pdserve up: ready\. gRPC (\S+)\s+HTTP (\S+).*\n"
                      r"\s*prefill workers: (.+)\n\s*decode workers: (.+)\n"
                      r"\s*metrics: (.+)\n")

# The shm stack that test_e2e_shm.py and test_e2e_shm_reservations.py share (conftest.py
# shm_stack). The gateway's lease ttl: short, so that prompts queued for prefill outlive it
# (renewed).
LEASE_TTL_S = 2.0
# the gateway's admission bounds while the decode pool is full
MAX_WAITING = 4
MAX_QUEUE_WAIT_S = 10.0
# the stack's KV dtype (what dtype "auto" resolves to here) and another one (other_decode)
STACK_DTYPE = dtype_name(resolve_dtype(None, torch.device("cpu")))
OTHER_DTYPE = "float32" if STACK_DTYPE == "bfloat16" else "bfloat16"


def _stub(address: str, cls):
    channel = grpc.insecure_channel(address)
    return channel, cls(channel)


@dataclass
class Stack:
    proc: subprocess.Popen
    log: Path
    grpc_addr: str
    http_url: str
    prefill: list[str]  # worker addresses, as `pdserve up` printed them
    decode: list[str]
    metrics: list[str]  # /metrics URLs: the gateway's, then each worker's (prefill first)
    _channels: list[grpc.Channel] = field(default_factory=list, repr=False)
    _stubs: dict = field(default_factory=dict, repr=False)

    def _cached(self, address: str, cls):
        key = (address, cls)
        if key not in self._stubs:
            channel, self._stubs[key] = _stub(address, cls)
            self._channels.append(channel)
        return self._stubs[key]

    def generation(self) -> pb_grpc.GenerationStub:
        return self._cached(self.grpc_addr, pb_grpc.GenerationStub)

    def prefill_stub(self, address: str) -> wpb_grpc.PrefillStub:
        return self._cached(address, wpb_grpc.PrefillStub)

    def decode_stub(self, address: str) -> wpb_grpc.DecodeStub:
        return self._cached(address, wpb_grpc.DecodeStub)

    def status_all(self) -> dict[str, wpb.WorkerStatus]:
        """Every worker's own Status RPC (not the gateway's view)."""
        out = {a: self.prefill_stub(a).Status(wpb.StatusRequest(), timeout=10)
               for a in self.prefill}
        out.update({a: self.decode_stub(a).Status(wpb.StatusRequest(), timeout=10)
                    for a in self.decode})
        return out

    def gateway_status(self) -> dict:
        return httpx.get(f"{self.http_url}/internal/status", timeout=10).json()

    def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, wpb.WorkerStatus]:
        """Poll every worker's Status until both pools are full again and nothing runs, waits
        or holds a reservation, and the gateway has no stream left."""
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = self.status_all()
            busy = {a: s for a, s in statuses.items() if not is_idle(s)}
            gw = self.gateway_status()
            if not busy and gw["num_streams"] == 0 and all(
                    w["in_flight"] == 0 for w in gw["workers"]):
                return statuses
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not idle after {timeout_s} s: workers {_fmt(busy)}; gateway streams "
                    f"{gw['num_streams']}, in flight "
                    f"{[(w['address'], w['in_flight']) for w in gw['workers']]}")
            time.sleep(0.05)

    def close_channels(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        self._stubs.clear()


def is_idle(s: wpb.WorkerStatus) -> bool:
    return (s.num_free_blocks == s.num_blocks > 0 and s.num_running == s.num_waiting
            == s.num_reserved == 0)


def _fmt(statuses: dict[str, wpb.WorkerStatus]) -> str:
    return "; ".join(
        f"{a} ({s.role}): free {s.num_free_blocks}/{s.num_blocks}, running {s.num_running}, "
        f"waiting {s.num_waiting}, reserved {s.num_reserved}" for a, s in statuses.items())


def spawn_stack(*up_args: str, env: dict[str, str] | None = None
                ) -> tuple[subprocess.Popen, Path]:
    """`pdserve up` on its defaults, on free ports (returns at once; see wait_stack); its
    engines check that every step computes on their device (engine_core/platforms/device_check.py).
    `env` adds to the environment.

    The canary (on by default: 10 s idle) is off unless up_args set --canary-idle-s: its
    synthetic requests, sent whenever a test pauses for 10 s, would move the counters and
    pools that tests compare before and after their own requests. test_e2e_canary.py runs it;
    tests/pdserve/test_cli.py checks that `pdserve up` and the gateway default to it."""
    canary = [] if "--canary-idle-s" in up_args else ["--canary-idle-s", "0"]
    return spawn_pdserve("up", "--port", "0", "--http-port", "0", "--kv-cache-memory-gb", "0.25",
                         *canary, *up_args, name="up",
                         env={"PDSERVE_CHECK_DEVICE": "1", **(env or {})})


def wait_stack(proc: subprocess.Popen, log: Path) -> Stack:
    try:
        m = wait_for_output(proc, log, UP_READY, STARTUP_TIMEOUT_S, "pdserve up")
    except RuntimeError:
        if proc.poll() is None:
            kill_tree(proc)
        raise
    return Stack(proc, log, m.group(1), m.group(2), m.group(3).split(), m.group(4).split(),
                 m.group(5).split())


def stop_stack(stack: Stack) -> int:
    """SIGTERM to `pdserve up`; its exit code (it and its workers are killed if it hangs)."""
    stack.close_channels()
    return stop_process(stack.proc, STOP_TIMEOUT_S)


# -- checks shared by the modules -------------------------------------------------------------
def check_word_completions(stack: Stack, prompts: list[list[int]], expected: list[list[int]],
                           max_tokens: int, timeout: float = 300) -> None:
    """Greedy /v1/completions of tiny-model prompts (token ids, sent as tests/tiny_model.py's
    words, EOS ignored): each text is the expected ids' words, special tokens (ids < 3) left
    out."""
    from tests.tiny_model import words

    for prompt, ids in zip(prompts, expected, strict=True):
        r = httpx.post(f"{stack.http_url}/v1/completions", timeout=timeout, json={
            "prompt": words(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text.split() == [f"w{i}" for i in ids if i >= 3], (text, ids)


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose labels contain `labels`."""
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def greedy(max_tokens: int, **kw) -> pb.SamplingParameters:
    return pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, **kw)


def run(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest,
        **kw) -> list[pb.GenerateResponse]:
    return list(stub.Generate(req, timeout=kw.pop("timeout", 120), **kw))


def out_ids(msgs: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def out_text(msgs: list[pb.GenerateResponse]) -> str:
    return "".join(m.text for m in msgs)


def check_timing(t) -> None:
    """The disaggregated timing breakdown (a pdserve.v1.Timing or the dict the OpenAI API
    adds to its last chunk): non-negative parts, queue + prefill + kv_transfer = ttft <= total."""
    get = t.get if isinstance(t, dict) else lambda k: getattr(t, k)
    parts = {k: get(k) for k in ("queue_s", "prefill_s", "kv_transfer_s",
                                 "first_decode_step_s", "ttft_s", "total_s")}
    assert all(v is not None and v >= 0 for v in parts.values()), parts
    assert parts["prefill_s"] > 0 and parts["ttft_s"] > 0, parts
    assert abs(parts["queue_s"] + parts["prefill_s"] + parts["kv_transfer_s"]
               - parts["ttft_s"]) <= 1e-6, parts
    assert parts["ttft_s"] <= parts["total_s"] < 120, parts


def counter(url: str, name: str, **labels) -> float:
    """Counter `pdserve:<name>_total` at a /metrics URL, summed over the samples whose labels
    include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "pdserve:" + name for s in f.samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v
                                                     for k, v in labels.items()))


def cacheable_tokens(num_prompt_tokens: int) -> int:
    """Prompt tokens a worker's prefix cache can serve: whole blocks, the last token never."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


class References:
    """An offline engine's greedy outputs (tests/conftest.py's Offline), computed on one
    thread: each worker of `pdserve up` runs on one pinned core with one thread too."""

    def __init__(self, offline) -> None:
        self.offline = offline
        self.tokenizer = offline.tokenizer
        self.layout = offline.llm.engine.layout  # the workers' KV layout (same settings)

    def generate(self, prompt: str | list[int], max_tokens: int, ignore_eos: bool = False):
        with torch_threads(1):
            return self.offline.generate(prompt, max_tokens, ignore_eos)

    def chat(self, conv: list[dict[str, str]], max_tokens: int):
        with torch_threads(1):
            return self.offline.chat(conv, max_tokens)


# -- probes of one worker's prefix cache (the test plays the gateway) --------------------------
def probe_decode_cache(stack: Stack, address: str, ids: list[int]) -> int:
    """Prompt tokens the decode worker at `address` has cached for `ids`: a Reserve, then an
    Abort (nothing is published by a reservation that never receives its KV)."""
    decode = stack.decode_stub(address)
    rid = f"probe-{uuid.uuid4().hex}"
    res = decode.Reserve(wpb.ReserveRequest(request_id=rid, prompt_token_ids=ids,
                                            sampling=greedy(1), lease_ttl_s=10), timeout=10)
    assert decode.Abort(wpb.AbortRequestRequest(request_id=rid, reason="probe"), timeout=10).found
    return res.num_cached_tokens


def handoff(stack: Stack, address: str, ids: list[int], decode_address: str,
            transport: str) -> tuple[wpb.PrefillResponse, int]:
    """A real handoff of `ids` by the prefill worker at `address` into a reservation on
    `decode_address` (of the blocks that worker lacks), aborted afterwards: the reply and the
    number of blocks shipped. Adds `ids` to that prefill worker's prefix cache."""
    decode = stack.decode_stub(decode_address)
    rid = f"probe-{uuid.uuid4().hex}"
    res = decode.Reserve(wpb.ReserveRequest(request_id=rid, prompt_token_ids=ids,
                                            sampling=greedy(1), lease_ttl_s=30), timeout=10)
    first = res.num_cached_tokens // BLOCK_SIZE
    try:
        reply = stack.prefill_stub(address).Prefill(wpb.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=greedy(1),
            target=wpb.KVTarget(transfer_address=res.transfer_address, lease_id=res.lease_id,
                                dst_block_ids=res.block_ids[first:], first_block=first,
                                transport=transport,
                                # as the gateway does: a connection to a restarted decode
                                # worker's previous instance handshakes again first
                                transfer_instance=res.transfer_instance)), timeout=60)
    finally:
        decode.Abort(wpb.AbortRequestRequest(request_id=rid, reason="probe"), timeout=10)
    assert reply.transport == transport
    return reply, len(res.block_ids) - first


# -- exact greedy output: the same checks over every transport ---------------------------------
N = 16  # tokens per greedy comparison
LONG = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from "
        "wine making. Within fifty years, printers in more than two hundred European cities had "
        "produced millions of books, and")  # 52 tokens: 4 KV blocks, 3 of them whole
PROMPTS = {"short": "The capital of France is", "code": "def fibonacci(n):\n    ", "long": LONG}
CONV = [{"role": "user", "content": "What is the capital of France?"}]


def check_greedy_text(stack: Stack, ref: References, prompt: str) -> None:
    msgs = run(stack.generation(), pb.GenerateRequest(text=prompt, sampling=greedy(N)))
    expected = ref.generate(prompt, N)
    assert out_ids(msgs) == expected.outputs[0].token_ids
    assert out_text(msgs) == expected.outputs[0].text
    last = msgs[-1].usage
    assert (last.prompt_tokens, last.completion_tokens) == (
        len(expected.prompt_token_ids), len(expected.outputs[0].token_ids))


def check_greedy_chat(stack: Stack, ref: References) -> None:
    req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**CONV[0])]),
                             sampling=greedy(N))
    msgs = run(stack.generation(), req)
    expected = ref.chat(CONV, N)
    assert out_ids(msgs) == expected.outputs[0].token_ids
    assert out_text(msgs) == expected.outputs[0].text
    assert msgs[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def check_repeat_hits_decode_cache(stack: Stack, ref: References, transport: str) -> None:
    """The same long prompt, once more than there are decode workers: some request lands on a
    decode worker that served it before (pigeonhole), which then reserves only the blocks it
    lacks (usage.cached_prompt_tokens: every whole block); every output is the same. A handoff
    into such a worker ships only the missing (last) block."""
    expected = ref.generate(LONG, N)
    ids = expected.prompt_token_ids
    cacheable = cacheable_tokens(len(ids))
    assert len(ids) > 2 * BLOCK_SIZE and cacheable == 48
    cached = []
    for _ in range(len(stack.decode) + 1):
        msgs = run(stack.generation(), pb.GenerateRequest(text=LONG, sampling=greedy(N)))
        assert out_ids(msgs) == expected.outputs[0].token_ids
        assert out_text(msgs) == expected.outputs[0].text
        cached.append(msgs[-1].usage.cached_prompt_tokens)
    assert set(cached) <= {0, cacheable} and cacheable in cached[1:], cached
    # the decode workers' own answer: the prompt's whole blocks are cached, or never came
    held = {a: probe_decode_cache(stack, a, ids) for a in stack.decode}
    assert set(held.values()) <= {0, cacheable} and cacheable in held.values(), held
    holder = next(a for a, n in held.items() if n)
    reply, num_sent = handoff(stack, stack.prefill[0], ids, holder, transport)
    assert num_sent == 1
    assert reply.transfer_bytes == ref.layout.num_layers * ref.layout.block_nbytes


# -- a stream that moved to another decode worker ----------------------------------------------
# the gateway's log line when it runs a request again elsewhere (gateway/disagg/backend.py)
RESUMED = re.compile(r"request (\S+): .*; running it again elsewhere \((\d+) tokens streamed "
                     r"so far\)")


def resume_points(log_text: str) -> dict[str, list[int]]:
    """Request id -> the numbers of tokens streamed when the gateway ran it again elsewhere."""
    points: dict[str, list[int]] = {}
    for m in RESUMED.finditer(log_text):
        points.setdefault(m.group(1), []).append(int(m.group(2)))
    return points


def check_continuation(ref: References, prompt: str, got: list[int], points: list[int]) -> None:
    """Token for token: each stretch of a greedy stream is the offline engine's greedy output
    for the prompt plus every token streamed before that stretch (its first stretch: the
    prompt's own). `points` are where the gateway resumed it (resume_points)."""
    n = len(got)
    prompt_ids = ref.generate(prompt, 1).prompt_token_ids
    bounds = [0, *sorted(points), n]
    for start, end in zip(bounds, bounds[1:], strict=False):
        if end == start:
            continue
        expected = ref.generate([*prompt_ids, *got[:start]], n - start,
                                ignore_eos=True).outputs[0].token_ids
        assert got[start:end] == expected[: end - start], (
            f"tokens {start}..{end} of the stream (resumed at {points}) differ from the offline "
            f"greedy continuation of the prompt + the {start} tokens before them")
