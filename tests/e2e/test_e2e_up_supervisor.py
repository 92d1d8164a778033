"""`pdserve up` as a supervisor, on the defaults a user gets, with 2 prefill + 2 decode workers
over shm (real processes, the real model):

1. kill -9 of a prefill worker with prompts on it: every request completes with the offline
   engine's greedy output; `pdserve up` restarts the worker at its old address, which serves
   again (a real handoff through it) within RESTART_S.
2. kill -9 of a decode worker with streams on it: every stream gets all its tokens, each
   stretch equal token for token to the offline engine's greedy continuation of the prompt
   plus the tokens streamed before it; the worker is restarted and takes KV again.
3. kill -9 of `pdserve up` itself: no process of the stack survives, and its ports are free.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    LONG,
    Stack,
    check_continuation,
    greedy,
    handoff,
    is_idle,
    out_ids,
    resume_points,
    run,
)
from tests.helpers import child_pids, descendants, is_alive, listeners, log_tail, wait_until

pytestmark = pytest.mark.slow

# a restarted worker loads the model again (~15 s alone here) while the rest of the stack
# and the test's offline reference share the 2 cores
RESTART_S = 90
PROMPTS = [f"Story {i}. {LONG}" for i in range(6)]  # distinct first blocks
PIDS = re.compile(r"^\s*pids: (.+)$", re.M)
BACK = re.compile(r"pdserve up: (\S+) is serving again at (\S+) \(pid (\d+)\)")


@pytest.fixture(scope="module")
def stack(stack_factory):
    start, stop = stack_factory
    s = start("--transport", "shm", "--prefill", "2", "--decode", "2")
    assert (len(s.prefill), len(s.decode)) == (2, 2)
    yield s
    if s.proc.poll() is None:  # test 3 kills it
        stop(s)


def pids(stack: Stack) -> dict[str, int]:
    """Each process's latest pid, from `pdserve up`'s output (its ready banner, then the
    restart lines)."""
    text = log_tail(stack.log, 10**7)
    out = {name: int(pid) for name, pid in
           (item.split("=") for item in PIDS.search(text).group(1).split())}
    out.update({m.group(1): int(m.group(3)) for m in BACK.finditer(text)})
    return out


def kill(stack: Stack, name: str) -> float:
    os.kill(pids(stack)[name], signal.SIGKILL)
    return time.monotonic()


def wait_back(stack: Stack, name: str, killed_at: float) -> str:
    """Wait for `pdserve up` to say the restarted `name` serves again; its address."""
    def back():
        matches = [m for m in BACK.finditer(log_tail(stack.log, 10**7)) if m.group(1) == name]
        return matches[-1] if matches else None

    match = wait_until(back, RESTART_S, f"{name} restarted and serving", interval_s=0.2)
    print(f"{name} serving again {time.monotonic() - killed_at:.1f} s after kill -9")
    return match.group(2)


def run_all(stack: Stack, max_tokens: int, when_started) -> list[list[pb.GenerateResponse]]:
    """PROMPTS at once (greedy, ignore_eos, request ids up-<i>); `when_started()` runs while
    they are in flight."""
    stub = stack.generation()

    def one(i: int):
        return run(stub, pb.GenerateRequest(text=PROMPTS[i], request_id=f"up-{i}-{max_tokens}",
                                            sampling=greedy(max_tokens, ignore_eos=True)),
                   timeout=300)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(one, i) for i in range(len(PROMPTS))]
        when_started()
        return [f.result() for f in futures]


def test_prefill_worker_killed_under_load(stack, ref):
    def in_flight(address: str) -> int:
        return next(w["in_flight"] for w in stack.gateway_status()["workers"]
                    if w["address"] == address)

    killed_at = 0.0

    def kill_when_busy():
        nonlocal killed_at
        wait_until(lambda: in_flight(stack.prefill[0]) > 0, 60, "prefill-0 busy",
                   interval_s=0.01)
        killed_at = kill(stack, "prefill-0")

    results = run_all(stack, 12, kill_when_busy)
    for prompt, msgs in zip(PROMPTS, results, strict=True):
        assert len(out_ids(msgs)) == msgs[-1].usage.completion_tokens == 12
        assert out_ids(msgs) == ref.generate(prompt, 12, ignore_eos=True).outputs[0].token_ids
    assert stack.gateway_status()["migrations"]["prefill"] > 0
    assert wait_back(stack, "prefill-0", killed_at) == stack.prefill[0]
    # serving: a real prefill and KV handoff through the restarted worker
    expected = ref.generate(PROMPTS[0], 1)
    reply, _ = handoff(stack, stack.prefill[0], expected.prompt_token_ids, stack.decode[0],
                       "shm")
    assert reply.first_token_id == expected.outputs[0].token_ids[0]
    assert "prefill-0 exited with code -9; restarting it in 1 s" in log_tail(stack.log, 10**7)


def test_decode_worker_killed_streams_continue(stack, ref):
    n = 160  # long enough that decode-0 is still streaming when killed
    killed_at = 0.0

    def kill_when_streaming():
        nonlocal killed_at
        decode = stack.decode_stub(stack.decode[0])
        wait_until(lambda: decode.Status(wpb.StatusRequest(), timeout=10).num_running > 0, 60,
                   "decode-0 streaming")
        time.sleep(0.2)  # some tokens out
        killed_at = kill(stack, "decode-0")

    results = run_all(stack, n, kill_when_streaming)
    points = resume_points(log_tail(stack.log, 10**7))
    resumed = 0
    for i, (prompt, msgs) in enumerate(zip(PROMPTS, results, strict=True)):
        got = out_ids(msgs)
        assert len(got) == msgs[-1].usage.completion_tokens == n  # every token, once
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        at = points.get(f"up-{i}-{n}", [])
        resumed += bool(at)
        check_continuation(ref, prompt, got, at)
    assert resumed > 0, "no stream was on decode-0 when it was killed"
    assert wait_back(stack, "decode-0", killed_at) == stack.decode[0]
    # taking KV again: a reservation and a handoff into the restarted worker
    ids = ref.generate(PROMPTS[1], 1).prompt_token_ids
    reply, num_sent = handoff(stack, stack.prefill[1], ids, stack.decode[0], "shm")
    assert num_sent == -(-len(ids) // 16)
    assert is_idle(stack.status_all()[stack.decode[0]])


def test_sigkill_of_up_leaves_no_process(stack):
    procs = child_pids(stack.proc.pid)
    assert len(procs) == 5, procs  # the gateway and 4 workers
    everyone = set(descendants(stack.proc.pid))  # and whatever they started
    ports = [int(a.rsplit(":", 1)[1]) for a in [stack.grpc_addr, *stack.prefill, *stack.decode]]
    assert all(listeners(port) & everyone for port in ports)  # the check below can fail
    stack.close_channels()
    stack.proc.kill()
    stack.proc.wait()

    wait_until(lambda: not [p for p in everyone if is_alive(p)], 10,
               f"the stack's processes {sorted(everyone)} to die with pdserve up")
    for port in ports:  # none of them listens any more (another program may take the port)
        assert not listeners(port) & everyone, port
