"""Decode steps over static, padded buffers (engine_core/decode_graphs.py), on the CPU.

CUDA graphs replay what the padded path computes; here that path runs eagerly, so what a graph
would compute is checked without a GPU: the same greedy tokens, bit-identical logits and a
bit-identical KV cache as the plain path, for batch sizes on and between bucket boundaries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from engine_core.decode_graphs import (
    DecodeGraphRunner,
    bucket_for,
    capture_sizes,
    graph_batch_size,
)
from engine_core.llm import LLM
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import SchedulerOutput
from tests.helpers import ROOT
from tests.tiny_model import write_tiny_llama

MAX_NUM_SEQS = 8  # buckets 1, 2, 4, 8
# request i decodes MAX_TOKENS[i] tokens: the batch shrinks 8, 7, ..., 1 (4 of them buckets)
MAX_TOKENS = [2, 3, 4, 5, 6, 7, 8, 9]
PROMPTS = [[(5 * i + 7 * j) % 500 + 3 for j in range(3 + 2 * i)] for i in range(8)]


def test_capture_sizes_follow_vllm_and_end_at_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(10) == (1, 2, 4, 8, 10)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    sizes = capture_sizes(300)
    assert sizes[-4:] == (256, 272, 288, 300)
    assert list(sizes) == sorted(set(sizes))
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 63, 64)] == [
        1, 2, 4, 4, 8, 8, 16, 24, 64, 64]
    assert bucket_for(65, sizes) is None
    with pytest.raises(ValueError, match="num_seqs"):
        bucket_for(0, sizes)


def _step(num_tokens: list[int], num_decodes: int, drafts: int = 0) -> SchedulerOutput:
    reqs = [Request(str(i), [3, 4, 5], SamplingParams()) for i in range(len(num_tokens))]
    for r in reqs[:num_decodes]:
        r.spec_token_ids = [7] * drafts
    return SchedulerOutput(reqs, num_tokens, num_decodes)


def test_only_plain_decode_only_steps_are_graph_eligible():
    sizes = (1, 2, 4)
    assert graph_batch_size(_step([1, 1, 1], 3), sizes, False) == 4
    assert graph_batch_size(_step([1], 1), sizes, False) == 1
    assert graph_batch_size(_step([1, 1, 5], 2), sizes, False) is None  # a prefill chunk
    assert graph_batch_size(_step([3, 3], 2, drafts=2), sizes, False) is None  # drafts
    assert graph_batch_size(_step([1, 1], 2), sizes, True) is None  # a layer observer
    assert graph_batch_size(_step([1] * 5, 5), sizes, False) is None  # past the last bucket
    assert graph_batch_size(SchedulerOutput(), sizes, False) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _llm(folder, **kwargs) -> LLM:
    return LLM(model=str(folder), dtype="float32", device="cpu", block_size=4,
               num_kv_blocks=96, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False,
               **kwargs)


def _run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy ids of every prompt, and the logits of every step in order. The cache starts
    from the same random (finite) values in every run, so a write anywhere shows."""
    runner = llm.engine.runner
    runner.kv_cache.copy_(_initial_kv(runner.kv_cache.shape))
    logits, plain_logits = [], runner.logits

    def recorded(hidden, num_quant_rows, *args, **kwargs):
        out = plain_logits(hidden, num_quant_rows, *args, **kwargs)
        logits.append(out.clone())
        return out

    runner.logits = recorded
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outs], logits


def _padded(llm: LLM) -> list[int]:
    """Give llm's runner the padded path, eagerly; returns the buckets its steps ran in."""
    runner = llm.engine.runner
    graphs = DecodeGraphRunner(runner, capture_sizes(MAX_NUM_SEQS), llm.engine.max_model_len,
                               use_cuda_graphs=False)
    buckets, run = [], graphs.run

    def counted(bucket, arrays, fill=None):
        buckets.append((len(arrays["input_ids"]), bucket))
        return run(bucket, arrays, fill)

    graphs.run = counted
    runner.graphs = graphs
    return buckets


def _initial_kv(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", ["native", "native-int8", "torch"])
def test_padded_decode_steps_equal_the_plain_path(tiny, variant, monkeypatch):
    """native: the CPU default on float weights (C attention, dense rows through torch's
    matmul). native-int8: --quantization int8, whose quantized decode rows are computed one by
    one, so padding changes no bit. torch: the torch attention path with dense rows. Dense
    rows round differently with the number of rows (oneDNN blocks by it: 1e-5 apart on the
    tiny model), so there logits and K/V agree closely, not bitwise, as a GPU's would between
    a graph's bucket and the eager batch."""
    exact = variant == "native-int8"
    kwargs = {}
    if variant == "native-int8":
        kwargs["quantization"] = "int8"
    if variant == "torch":
        monkeypatch.setenv("PDSERVE_ATTN_BACKEND", "torch")
        kwargs["quantize_decode"] = False
    plain = _llm(tiny, **kwargs)
    padded = _llm(tiny, **kwargs)
    assert plain.engine.runner.graphs is None  # a CPU engine never uses graphs by itself
    buckets = _padded(padded)
    want_ids, want_logits = _run(plain)
    got_ids, got_logits = _run(padded)
    assert got_ids == want_ids
    assert [len(ids) for ids in got_ids] == MAX_TOKENS
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-4)
    got_kv, want_kv = padded.engine.runner.kv_cache, plain.engine.runner.kv_cache
    # the padded rows wrote no K/V anywhere: the same cache entries changed, used or not
    initial = _initial_kv(got_kv.shape)
    assert torch.equal(got_kv != initial, want_kv != initial)
    assert torch.equal(got_kv, want_kv) if exact else torch.allclose(got_kv, want_kv, atol=1e-4)
    # every decode step ran padded, on bucket boundaries (8, 4, 2, 1) and between them
    assert buckets == [(n, bucket_for(n, capture_sizes(MAX_NUM_SEQS))) for n in range(8, 0, -1)]
    assert padded.engine.runner.graphs.num_padded_steps == 8
    assert padded.engine.runner.graphs.num_replays == 0  # no CUDA graph on a CPU


def test_padded_rows_write_no_kv(tiny):
    """One step of 3 decodes in bucket 4: only the 3 real slots of the cache change."""
    llm = _llm(tiny, quantize_decode=False)
    runner = llm.engine.runner
    graphs = DecodeGraphRunner(runner, (1, 4), llm.engine.max_model_len, use_cuda_graphs=False)
    kv = runner.kv_cache
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(2)))
    before = kv.clone()
    slots = np.array([5, 17, 40], dtype=np.int64)
    arrays = {
        "input_ids": np.array([3, 4, 5], dtype=np.int64),
        "positions": slots % 4,  # each the last position of its context
        "slot_mapping": slots,
        "decode_context_lens": (slots % 4 + 1).astype(np.int32),
        "decode_block_tables": (slots // 4).astype(np.int32)[:, None],  # one block each
    }
    hidden = graphs.run(4, arrays)
    assert hidden.shape == (3, llm.engine.model_config.hidden_size)
    # (layer, block, K or V, offset) of every changed cache row: [L, blocks, 2, block_size]
    changed = (kv != before).any(-1).any(-1).nonzero().tolist()
    assert sorted({block * 4 + offset for _, block, _, offset in changed}) == slots.tolist()
    with pytest.raises(ValueError, match="do not fit bucket"):
        graphs.run(1, arrays)
    with pytest.raises(ValueError, match="do not fit bucket"):
        graphs.run(2, arrays)  # not a capture size
    graphs.use_cuda_graphs = True  # as on a GPU before capture()
    with pytest.raises(RuntimeError, match="call capture"):
        graphs.run(4, arrays)
    assert graphs.num_padded_steps == 1


def test_cuda_graphs_refuse_a_cpu_engine_and_enforce_eager_reaches_the_engine(tiny):
    llm = _llm(tiny, enforce_eager=True)
    assert llm.engine.runner.graphs is None
    assert llm.engine.decode_mode == "eager (no CUDA graphs on cpu)"
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphRunner(llm.engine.runner, (1, 2), 64, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphRunner(llm.engine.runner, (2, 1), 64, use_cuda_graphs=False)


TRITON_SCRIPT = """
import json, sys
import torch
import tests.engine_core.test_decode_graphs as t
from tests.helpers import count_split_combines
combines = count_split_combines()
t.PROMPTS, t.MAX_TOKENS = t.PROMPTS[:3], [2, 2, 3]  # decode batches of 3 (bucket 4), then 1
plain, padded = (t._llm(sys.argv[1], quantize_decode=False) for _ in range(2))
buckets = t._padded(padded)
(want_ids, want_logits), (got_ids, got_logits) = t._run(plain), t._run(padded)
initial = t._initial_kv(plain.engine.runner.kv_cache.shape)
got_kv, want_kv = padded.engine.runner.kv_cache, plain.engine.runner.kv_cache
print(json.dumps({
    "ids_equal": got_ids == want_ids, "buckets": buckets,
    "logits_diff": max((g - w).abs().max().item() for g, w in zip(got_logits, want_logits)),
    "same_kv_written": torch.equal(got_kv != initial, want_kv != initial),
    "kv_diff": (got_kv - want_kv).abs().max().item(),
    "triton": "kernels.decode_attention" in sys.modules, "combines": len(combines),
    "fused_moe": "kernels.fused_moe" in sys.modules}))
"""


# a one-layer mixture of experts: 4 experts, 2 per token (the padding rows route too)
MOE = {"config_cls": transformers.Qwen3MoeConfig, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "norm_topk_prob": True}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen3-moe"])
def test_padded_decode_steps_on_the_triton_kernels(tmp_path, model):
    """The kernels a CUDA graph captures, through the Triton interpreter in a fresh process
    (it must be on before triton's first import; the C kernels off): one small case, on a
    one-layer model (the interpreter's cost is per kernel call). Each context is split in 3,
    as a card splits a small batch's (kernels/decode_split.py): the padding rows' one-position
    contexts leave two splits empty. The mixture of experts runs its grouped expert matmuls
    (kernels/fused_moe.py), where the padding rows' pairs join the real rows' programs."""
    tiny = write_tiny_llama(tmp_path, num_hidden_layers=1, **(MOE if model != "llama" else {}))
    env = {**os.environ, "PDSERVE_NATIVE": "0", "PDSERVE_ATTN_BACKEND": "triton",
           "TRITON_INTERPRET": "1", "PDSERVE_DECODE_SPLITS": "3"}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(tiny)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["triton"] and result["combines"] > 0
    assert result["fused_moe"] == (model != "llama")
    assert result["buckets"] == [[3, 4], [1, 1]]
    assert result["ids_equal"]
    assert result["same_kv_written"]
    assert result["logits_diff"] < 1e-4 and result["kv_diff"] < 1e-4


def test_the_replay_counter_is_exported(tiny):
    """pdserve:decode_graph_replays reads the runner's counter (0 without graphs)."""
    from service_infra.metrics.worker import EngineCollector

    llm = _llm(tiny, quantize_decode=False)

    def replays() -> float:
        families = {f.name: f for f in EngineCollector("decode", "tiny", llm.engine).collect()}
        return families["pdserve:decode_graph_replays"].samples[0].value

    assert replays() == 0
    graphs = DecodeGraphRunner(llm.engine.runner, (1,), 64, use_cuda_graphs=False)
    llm.engine.runner.graphs = graphs
    graphs.num_replays = 5  # what replays on a GPU would have counted
    assert replays() == 5
