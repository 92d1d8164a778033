"""The host-overhead workload's offline side (pdserve/bench/host_overhead.py): the offline engine
in a process of its own, on the dtype it is given or on the CPU's default, as the served stack
runs; its figures are per generated token. (The served side starts `pdserve up`: the benchmark
itself, not a test.)"""

from __future__ import annotations

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
