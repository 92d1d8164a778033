"""CUDA graphs for decode steps (engine_core/decode_graphs.py) on the card: captured at
start, replayed by decode-only steps, equal to the eager engine, for a dense model and a
mixture of experts. Skipped without CUDA."""

from __future__ import annotations

import pytest
import transformers

from engine_core.decode_graphs import capture_sizes
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.tiny_model import words, write_tiny_llama

pytestmark = pytest.mark.gpu

MAX_NUM_SEQS = 8  # buckets 1, 2, 4, 8
# six prompts of staggered output lengths: the decode batch shrinks 6, 5, ..., 1, so steps
# replay on bucket boundaries (4, 2, 1) and between them (6, 5, 3, padded)
PROMPTS = [[5, 9, 200, 31], list(range(3, 70)), [(7 * i) % 500 + 3 for i in range(300)],
           [11], list(range(100, 120)), [42] * 17]
MAX_TOKENS = [24, 20, 16, 12, 8, 4]


@pytest.fixture(autouse=True)
def _check_device(monkeypatch):
    """Every step asserts it computes on the card (engine_core/platforms/device_check.py): the graph
    path reads no host tensor inside a step."""
    monkeypatch.setenv("PDSERVE_CHECK_DEVICE", "1")


# a mixture of experts (4 experts, 2 per token, the first layer dense): its experts run as
# grouped matmuls (kernels/fused_moe.py), inside the graphs
MOE = {"config_cls": transformers.Qwen3MoeConfig, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [0]}


@pytest.fixture(scope="module", params=["llama", "qwen3-moe"])
def tiny(request, tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp(request.param),
                            **(MOE if request.param != "llama" else {}))


def greedy(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([words(p) for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def engines(tiny, dtype: str) -> tuple[LLM, LLM]:
    """(eager, graphed): the same engine with enforce_eager and without."""
    kwargs = dict(model=str(tiny), dtype=dtype, device="cuda", kv_cache_memory_gb=0.25,
                  max_num_seqs=MAX_NUM_SEQS)
    eager = LLM(**kwargs, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert eager.engine.decode_mode == "eager (enforce_eager)"
    graphed = LLM(**kwargs)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None, graphed.engine.decode_mode
    assert sorted(graphs.graphs) == list(capture_sizes(MAX_NUM_SEQS))
    assert graphs.capture_seconds is not None
    return eager, graphed


def assert_replayed(graphed: LLM) -> None:
    """Every decode-only step replayed a graph: each step after the first (which prefilled
    every prompt) of the longest request."""
    graphs = graphed.engine.runner.graphs
    assert graphs.num_replays == graphs.num_padded_steps
    assert graphs.num_replays >= max(MAX_TOKENS) - 1


def test_cuda_graphs_on_and_off_give_equal_greedy_output(tiny):
    """float32: a bucket's padded matmuls may round a row differently from the eager batch's
    (cuBLAS picks kernels by size), by far less than a greedy choice needs to flip."""
    eager, graphed = engines(tiny, "float32")
    want = greedy(eager)
    got = greedy(graphed)
    assert [len(ids) for ids in got] == MAX_TOKENS
    assert got == want
    assert_replayed(graphed)


def test_cuda_graphs_replay_in_bfloat16(tiny):
    """bf16, the default on a GPU: rounding differences between a bucket and the eager batch
    can flip a near-tie, so whole continuations are compared only in number."""
    eager, graphed = engines(tiny, "bfloat16")
    want = greedy(eager)
    got = greedy(graphed)
    assert [len(ids) for ids in got] == MAX_TOKENS
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= len(PROMPTS) // 2
    assert_replayed(graphed)
