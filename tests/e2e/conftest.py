"""The end-to-end stacks: see stack.py. Each module starts one `pdserve up` stack through
stack_factory and shares it, or shares one with another module (spec_stack, shm_stack); the
offline reference engine loads while the stack loads."""

from __future__ import annotations

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.stack import (
    LEASE_TTL_S,
    MAX_QUEUE_WAIT_S,
    MAX_WAITING,
    OTHER_DTYPE,
    References,
    Stack,
    spawn_stack,
    stop_stack,
    wait_stack,
)
from tests.helpers import kill_tree, log_tail, spawn_pdserve, stop_process


@pytest.fixture(scope="session")
def stack_factory(request):
    """start(*up_args) -> Stack with the offline engine loaded meanwhile; stop(stack) asserts
    a clean exit (code 0, no traceback in any process's output)."""

    def start(*up_args: str) -> Stack:
        proc, log = spawn_stack(*up_args)
        try:
            request.getfixturevalue("ref")  # the offline engine loads while the stack loads
        except BaseException:
            kill_tree(proc)
            raise
        return wait_stack(proc, log)

    def stop(stack: Stack) -> None:
        code = stop_stack(stack)
        text = log_tail(stack.log, 10**7)
        assert code == 0, f"pdserve up exited with {code}:\n{text[-4000:]}"
        assert "Traceback" not in text, text[-8000:]
        stack.log.unlink(missing_ok=True)

    return start, stop


@pytest.fixture(scope="session")
def spec_stack(stack_factory, tmp_path_factory) -> Stack:
    """A `pdserve up --speculative ngram` stack (1 prefill + 1 decode over shm), shared by the
    speculative decoding and the metrics modules; with a disk offload tier, so that its
    metrics are exported too (the tier only ever serves what the pools evicted)."""
    start, stop = stack_factory
    s = start("--transport", "shm", "--speculative", "ngram", "--num-speculative-tokens", "4",
              "--kv-offload-dir", str(tmp_path_factory.mktemp("kv-offload")))
    yield s
    stop(s)


@pytest.fixture(scope="session")
def other_decode():
    """A lone decode worker whose KV cache has OTHER_DTYPE, a layout that differs from the
    shm stack's: (process, log). It loads alongside that stack; the test waits for its READY
    line."""
    proc, log = spawn_pdserve("decode", "--dtype", OTHER_DTYPE, "--port", "0",
                              "--kv-cache-memory-gb", "0.05", name="decode-other-dtype")
    try:
        yield proc, log
        assert stop_process(proc, 30) == 0, log_tail(log)
        assert "Traceback" not in log.read_text(), log_tail(log)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def shm_stack(stack_factory, other_decode):  # the other worker loads alongside the stack
    """A `pdserve up --transport shm` stack (1 prefill + 1 decode) with a short lease ttl and
    bounded admission (stack.py), shared by test_e2e_shm.py and test_e2e_shm_reservations.py."""
    start, stop = stack_factory
    s = start("--transport", "shm", "--lease-ttl", str(LEASE_TTL_S), "--max-waiting",
              str(MAX_WAITING), "--max-queue-wait", str(MAX_QUEUE_WAIT_S))
    assert (len(s.prefill), len(s.decode)) == (1, 1)
    yield s
    stop(s)


@pytest.fixture(scope="session")
def ref(offline_default) -> References:
    """The reference of the `pdserve up` stacks: the offline engine on the same defaults."""
    return References(offline_default)


@pytest.fixture(scope="session")
def ref_chats(model_path) -> References:
    """The reference of chats served over several turns. Decode workers keep the KV of the
    replies they decode (--cache-decoded-blocks, on by default), so a follow-up continues from
    the decode-computed KV of the previous reply, not from a cold prefill of it: its reference
    is an offline engine that keeps its replies too and has run the chat's earlier turns
    (batch-invariant decode: the same KV, bit for bit). Call it turn by turn, in order."""
    from engine_core.llm import LLM
    from tests.conftest import Offline

    return References(Offline(LLM(str(model_path), kv_cache_memory_gb=0.25,
                                  cache_decoded_blocks=True)))


@pytest.fixture(scope="session")
def ref_fp32(offline) -> References:
    """The reference of the float32 cluster (tests/e2e/cluster.py): the exact path."""
    return References(offline)


@pytest.fixture(autouse=True)
def _idle_after(request):
    """Every test that uses a module's `stack` leaves both pools full and nothing running."""
    yield
    if "stack" in request.fixturenames:
        stack = request.getfixturevalue("stack")
        if stack.proc.poll() is None:  # (a test may have killed `pdserve up` on purpose)
            stack.wait_idle()


@pytest.fixture(scope="module")
def cluster(request) -> Cluster:
    """2 prefill + 2 decode workers and a gateway as separate processes (tests/e2e/cluster.py),
    one per module that asks: fault tests kill and restart its workers."""
    c = Cluster()
    c.start()
    try:
        request.getfixturevalue("ref_fp32")  # the offline engine loads meanwhile
        c.wait_gateway()
        yield c
    except BaseException:
        for name, (_proc, log) in c.procs.items():
            print(f"--- {name}\n{log_tail(log)}")
        raise
    finally:
        c.stop()
