"""`pdserve up --kv-offload-dir` (the default model, 1 prefill + 1 decode over shm) with pools
too small for two long prompts: the second evicts the first from both pools, and when the
first returns, the prefill worker loads its history from the disk tier the two workers share
instead of recomputing it, with the same greedy output; the gateway sees the tier's blocks and
load speed in the worker's Status. The engine-level tests
(tests/engine_core/test_kv_offload_engine.py) cover the rest: restarts, corruption, Redis,
preemption, aborts."""

from __future__ import annotations

import time

import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import (
    BLOCK_SIZE,
    LONG,
    counter,
    greedy,
    out_ids,
    run,
    spawn_stack,
    stop_stack,
    wait_stack,
)
from tests.helpers import kill_tree, log_tail

pytestmark = pytest.mark.slow

N = 8
# each about 12 x 52 tokens: one fits a pool of 0.04 GiB (about 900 tokens of the default
# model's KV in float32), two do not
CHATS = {name: f"Chat {name}. " + " ".join([LONG] * 12) for name in ("A", "B")}


def test_up_loads_an_evicted_history_from_the_disk_tier(tmp_path):
    tier = tmp_path / "kv"
    proc, log = spawn_stack("--transport", "shm", "--dtype", "float32",
                            "--kv-cache-memory-gb", "0.04",
                            "--kv-offload-dir", str(tier), "--kv-offload-disk-gb", "1")
    try:
        stack = wait_stack(proc, log)
    except BaseException:
        kill_tree(proc)
        raise
    try:
        gen = stack.generation()
        first = run(gen, pb.GenerateRequest(text=CHATS["A"], sampling=greedy(N)))
        run(gen, pb.GenerateRequest(text=CHATS["B"], sampling=greedy(N)))  # evicts A's blocks
        stack.wait_idle()
        prefill = stack.metrics[1]
        assert counter(prefill, "kv_offload_hits", tier="disk") == 0
        # both prompts' full blocks, stored by the prefill worker that computed them; the
        # decode worker stores only what it computed: at most the one block each 8-token
        # reply completes
        num_full = 2 * 12 * 52 // BLOCK_SIZE - 4
        assert counter(prefill, "kv_offload_stores", tier="disk") >= num_full
        assert counter(stack.metrics[2], "kv_offload_stores", tier="disk") <= 2
        assert len(list(tier.rglob("*.kv"))) >= num_full
        # the prefill worker's Status lists what it stored in the tiers (no Redis here), and
        # the directory's identity, which any worker given the directory shares
        statuses = stack.status_all()
        (stored_status,) = [st for st in statuses.values() if st.role == "prefill"]
        assert len(stored_status.offload_block_hashes) >= num_full
        (tier_id,) = tier.glob("*/tier-id")
        assert list(stored_status.offload_tier_ids) == [f"disk:{tier_id.read_text()}"]
        time.sleep(1.5)  # the gateway's Status refresh (every second) has seen it
        again = run(gen, pb.GenerateRequest(text=CHATS["A"], sampling=greedy(N)))
        # the gateway priced A's return with its history in the prefill worker's tiers:
        # only the tokens after its last full block are computed there
        last = stack.gateway_status()["prefill_placement"]["last"]
        assert last["num_remote_tokens"] <= BLOCK_SIZE, last
        assert out_ids(again) == out_ids(first)
        hits = counter(prefill, "kv_offload_hits", tier="disk")
        assert hits >= 12 * 52 // BLOCK_SIZE - 4, hits  # the history, not recomputed
        assert counter(prefill, "kv_offload_corrupt", tier="disk") == 0
        assert counter(prefill, "kv_offload_errors", tier="disk") == 0
        (loaded_status,) = [st for st in stack.status_all().values() if st.role == "prefill"]
        assert loaded_status.offload_load_tokens_per_s > 0  # measured by that load
        stack.wait_idle()  # every block back in both pools
    finally:
        code = stop_stack(stack)
    text = log_tail(stack.log, 10**7)
    assert code == 0 and "Traceback" not in text, text[-4000:]
