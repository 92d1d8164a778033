"""The host-overhead workload's offline side (pdserve/bench/host_overhead.py): the offline engine
in a process of its own, on the dtype it is given or on the CPU's default, as the served stack
runs; its figures are per generated token; and the served stack's pids, read from `pdserve up`'s
log. (The served side starts `pdserve up`: the benchmark itself, not a test.)"""

from __future__ import annotations

import threading
import time

import pytest
from transformers import AutoTokenizer

from pdserve.bench import host_overhead as ho
from pdserve.bench.tiny_model import bench_tiny_model


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_the_offline_engine_runs_on_the_stacks_dtype(dtype):
    model = str(bench_tiny_model())
    cfg = ho.HostConfig(model=model, concurrency=4, num_prompts=8, input_len=8, output_len=6,
                        dtype=dtype)
    batch = ho.requests(cfg, AutoTokenizer.from_pretrained(model), seed=0)
    assert len(batch) == 8 and all(len(r.prompt_ids) == 8 for r in batch)
    got = ho.offline(cfg, None, batch)
    assert got["tokens_per_s"] > 0 and got["cpu_us_per_token"] > 0
    # a dtype the engine refuses fails the run loudly, naming the failure
    with pytest.raises(RuntimeError, match="offline run failed"):
        ho.offline(ho.HostConfig(model=model, concurrency=2, output_len=2, dtype="int3"), None,
                   batch)


def test_the_stacks_pids_are_waited_for(tmp_path):
    """`pdserve up` prints its pids once its gateway's ready line reached it, which can come
    after the gateway answers health checks: they are read when they come, by role; a log
    that never gets them fails, naming it."""
    log = tmp_path / "disagg.log"
    log.write_text("pdserve up: 1 prefill + 1 decode\n")

    def later() -> None:
        time.sleep(0.3)
        with open(log, "a") as f:
            f.write("  pids: gateway=11 prefill-0=12 decode-0=13 decode-1=14\n")

    writer = threading.Thread(target=later)
    writer.start()
    try:
        assert ho.stack_pids(log, timeout_s=10.0) == {
            "gateway": [11], "prefill": [12], "decode": [13, 14]}
    finally:
        writer.join()
    empty = tmp_path / "empty.log"
    empty.write_text("pdserve up: stopping\n")
    with pytest.raises(RuntimeError, match="printed no pids"):
        ho.stack_pids(empty, timeout_s=0.2)
