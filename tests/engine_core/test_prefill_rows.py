"""Prefill rows are batch and thread invariant on the CPU (platforms/cpu/prefill_matmuls.py):
torch's matmuls round a row differently with other rows beside it (oneDNN's AMX bf16 kernels
from 33 rows on, MKL's float32 from 2 rows on), so bf16 projections multiply in calls of one
shape (where torch's own calls were found to vary) and float32 ones under MKL's strict
reproducibility. Shapes are Gemma 3 270M's and SmolLM2's, wide enough for the kernels that
differ, and the tiny bench model's; the engine test prefills a prompt alone
and beside others in the CPU's default dtype."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from engine_core.platforms.cpu import cpu_has_fast_bf16
from engine_core.platforms.cpu import prefill_matmuls as pm
from engine_core.platforms.cpu.prefill_mlp import SlabbedMLP, slab_mlps
from engine_core.sampling_params import SamplingParams
from tests.engine_core import tiny_models as tm

# (in, out): Gemma 3 270M's and SmolLM2-135M's fused projections, and the tiny bench model's
SHAPES = [(640, 1536), (640, 4096), (2048, 640), (576, 960), (576, 3072), (1536, 576),
          (640, 256), (128, 256), (256, 128)]
ROW_COUNTS = [1, 7, 33, 64, 65, 150]
HEAD = (640, 32768)  # a vocabulary-sized head (Gemma's is 262,144)


def _rows_alone_and_beside(linear: nn.Module, x: torch.Tensor) -> list[str]:
    """Where linear's rows beside others (any count, any offset) differ from the same rows
    multiplied alone; also with 1 thread against 2."""
    alone = torch.cat([linear(x[i:i + 1]) for i in range(x.shape[0])])
    bad = []
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for m in ROW_COUNTS:
                for start in (0, 3):
                    if not torch.equal(linear(x[start:start + m]), alone[start:start + m]):
                        bad.append(f"{m} rows from {start}, {t} threads")
    finally:
        torch.set_num_threads(threads)
    return bad


class _Model(nn.Module):
    def __init__(self, shapes, dtype: torch.dtype) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Linear(k, n, bias=i % 2 == 0)
                                         for i, (k, n) in enumerate(shapes))
        self.lm_head = nn.Linear(*HEAD, bias=False)
        self.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_projection_row_is_the_same_beside_any_rows(dtype):
    if dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        pytest.skip("bf16 is not this CPU's dtype: torch emulates its matmuls (slow)")
    torch.manual_seed(0)
    model = _Model(SHAPES, dtype)
    pm.block_prefill_rows(model)
    for linear in [*model.projections, model.lm_head]:
        x = torch.randn(ROW_COUNTS[-1] + 3, linear.in_features).to(dtype)
        with torch.inference_mode():
            assert _rows_alone_and_beside(linear, x) == [], (dtype, linear)


def test_projections_whose_rows_vary_are_blocked_and_float32_ones_left_to_mkl():
    """A bf16 projection is blocked exactly where torch's own calls were found to vary (the
    others are bucketed); a head too large to try is blocked anyway; float32 is left to MKL's
    strict mode."""
    bf16 = _Model(SHAPES, torch.bfloat16)
    vary = [pm.rows_vary(k, n, torch.bfloat16, i % 2 == 0) for i, (k, n) in enumerate(SHAPES)]
    assert pm.block_prefill_rows(bf16) == sum(vary) + 1
    assert [type(p) is pm.RowBlockedLinear for p in bf16.projections] == vary
    assert all(type(p) is pm.RowBucketedLinear
               for p, v in zip(bf16.projections, vary, strict=True) if not v)
    assert all(p.rows == pm.block_rows(p.in_features, p.out_features, torch.bfloat16,
                                       p.bias is not None) and p.rows in pm.BLOCK_ROWS
               for p in bf16.projections if type(p) is pm.RowBlockedLinear)
    assert type(bf16.lm_head) is pm.RowBlockedLinear and bf16.lm_head.rows == pm.HEAD_ROWS
    fp32 = _Model(SHAPES[:1], torch.float32)
    assert pm.block_prefill_rows(fp32) == 0 and type(fp32.projections[0]) is nn.Linear
    # what MKL_CBWR (engine_core/openmp_env.py, imported before torch here) is for
    assert not pm.float32_rows_vary()


def test_the_probe_finds_rows_that_vary(monkeypatch):
    """rows_vary on a matmul that rounds a row differently beside others (as oneDNN's AMX
    kernels do from 33 rows on), and on one that does not."""
    real = torch.nn.functional.linear

    def rounds_by_count(x, w, b=None):
        out = real(x, w, b)
        return out + 1 if x.shape[0] >= 33 else out

    pm.rows_vary.cache_clear()
    try:
        assert not pm.rows_vary(32, 48, torch.bfloat16, False)
        pm.rows_vary.cache_clear()
        monkeypatch.setattr(pm.F, "linear", rounds_by_count)
        assert pm.rows_vary(32, 48, torch.bfloat16, False)
    finally:
        pm.rows_vary.cache_clear()


def test_a_blocked_projection_computes_what_linear_does():
    torch.manual_seed(1)
    blocked = nn.Linear(64, 96).to(torch.bfloat16)
    plain = nn.Linear(64, 96).to(torch.bfloat16)
    plain.load_state_dict(blocked.state_dict())
    blocked.__class__ = pm.RowBlockedLinear
    for shape in [(0, 64), (1, 64), (64, 64), (130, 64), (2, 70, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        got, want = blocked(x), plain(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_a_bucketed_projection_computes_what_linear_does_in_few_shapes(monkeypatch):
    """Any row count gives linear's result, in calls of at most 4 + rows / 64 shapes (oneDNN
    compiles a kernel per shape and caches 1,024)."""
    torch.manual_seed(2)
    bucketed = nn.Linear(64, 96).to(torch.bfloat16)
    plain = nn.Linear(64, 96).to(torch.bfloat16)
    plain.load_state_dict(bucketed.state_dict())
    bucketed.__class__ = pm.RowBucketedLinear
    for shape in [(0, 64), (1, 64), (16, 64), (17, 64), (64, 64), (65, 64), (130, 64),
                  (2, 70, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        got, want = bucketed(x), plain(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    calls = []
    real = pm.F.linear
    monkeypatch.setattr(pm.F, "linear", lambda x, w, b=None: calls.append(x.shape[0])
                        or real(x, w, b))
    x = torch.randn(2048, 64).to(torch.bfloat16)
    for m in range(1, 2049):
        assert bucketed(x[:m]).shape == (m, 96)
    assert all(m <= c < m + pm.BUCKET_ROWS for m, c in zip(range(1, 2049), calls, strict=True))
    assert len(set(calls)) == pm.BUCKET_ROWS // pm.BUCKET_SMALL + 2048 // pm.BUCKET_ROWS - 1


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_prompt_prefilled_beside_others_gives_what_it_gives_alone(tmp_path, quantization):
    """A model of Gemma 3 270M's widths in the CPU's default dtype, its decode rows in the C
    layers as loaded (the default for a float model) or in int8 blocks with the default
    activations (int8 where VNNI is, as a GGUF's default): a 70-token prompt's prompt
    logprobs (every prefill row through the head), first token and greedy continuation are
    the same alone and in one step with two other prompts."""
    tm.build_hf(transformers.LlamaConfig, tmp_path, hidden_size=640, intermediate_size=2048,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                head_dim=256, vocab_size=4096, max_position_embeddings=512)
    eng = tm.engine(tmp_path, dtype="auto", block_size=16, enable_prefix_caching=False,
                    quantize_decode=True, quantization=quantization)
    prompts = tm.prompts(4096, [70, 45, 90], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)

    def run(batch, which):
        ids = [eng.add_request(p, params) for p in batch]
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        out = done[ids[which]]
        return out.prompt_logprobs, out.outputs[0].token_ids, out.outputs[0].logprobs

    alone = run(prompts[:1], 0)
    assert alone[0] is not None and len(alone[1]) == 6
    assert run([prompts[1], prompts[0], prompts[2]], 1) == alone  # rows 45 to 114 of 205
    assert run(prompts, 0) == alone


def test_a_packed_projection_gives_the_unpacked_results_and_shared_weights_stay():
    """block_prefill_rows packs a blocked projection's weight in oneDNN's form for its call
    size (pack_weight) where the packed calls give torch's own results bit for bit; not the
    head, nor a weight whose storage something else holds (a tied embedding, the C kernels'
    view of a float weight), which packing would copy."""
    if not cpu_has_fast_bf16():
        pytest.skip("bf16 is not this CPU's dtype: torch emulates its matmuls (slow)")
    torch.manual_seed(3)
    model = _Model([(640, 1536), (640, 1536)], torch.bfloat16)
    model.view = model.projections[1].weight.detach()  # e.g. NativeFloatMatmul.qs
    plain = _Model([(640, 1536), (640, 1536)], torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    pm.block_prefill_rows(model)
    first, second = model.projections
    assert type(first) is pm.RowBlockedLinear
    expected = pm.packs_exactly(640, 1536, torch.bfloat16, True, first.rows)
    assert first.is_packed == expected and first.weight.is_mkldnn == expected
    assert not second.is_packed and not model.lm_head.is_packed
    unpacked = pm.RowBlockedLinear(640, 1536, dtype=torch.bfloat16)
    unpacked.load_state_dict(plain.projections[0].state_dict())
    unpacked.rows = first.rows
    x = torch.randn(2 * first.rows + 3, 640).to(torch.bfloat16)
    with torch.inference_mode():
        for m in (0, 1, first.rows - 1, first.rows, first.rows + 1, 2 * first.rows + 3):
            assert torch.equal(first(x[:m]), unpacked(x[:m])), m


def test_a_slabbed_mlp_gives_one_pass_results_bit_for_bit():
    """slab_mlps makes a gated MLP with blocked projections a SlabbedMLP: its rows
    go through in slabs of the projections' largest call size, with the one-pass results,
    bit for bit, at any row count; a step with quantized decode rows takes one pass."""
    from engine_core.config import ModelConfig
    from engine_core.model.feed_forward import MLP
    from engine_core.model.forward_context import ForwardContext, use

    if not cpu_has_fast_bf16():
        pytest.skip("bf16 is not this CPU's dtype: torch emulates its matmuls (slow)")
    torch.manual_seed(4)
    cfg = ModelConfig(name="m", vocab_size=8, hidden_size=640, intermediate_size=2048,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64)
    holder = nn.Module()
    holder.mlp, holder.lm_head = MLP(cfg).to(torch.bfloat16), nn.Linear(8, 8)
    one_pass = MLP(cfg).to(torch.bfloat16)
    one_pass.load_state_dict(holder.mlp.state_dict())
    pm.block_prefill_rows(holder)
    assert slab_mlps(holder) == 1
    mlp = holder.mlp
    assert type(mlp) is SlabbedMLP
    for name in ("gate_up_proj", "down_proj"):  # the same calls (unpacked), in one pass
        p, blocked = getattr(one_pass, name), getattr(mlp, name)
        p.__class__, p.rows = type(blocked), getattr(blocked, "rows", None)
    b = mlp.slab_rows
    assert b == max(mlp.gate_up_proj.rows, mlp.down_proj.rows)
    x = torch.randn(3 * b + 5, 640).to(torch.bfloat16)
    with torch.inference_mode():
        for m in (1, b, b + 1, 2 * b, 3 * b + 5):
            assert torch.equal(mlp(x[:m]), one_pass(x[:m])), m
        calls = []
        real = MLP.forward
        MLP.forward = lambda self, x: calls.append(x.shape[0]) or real(self, x)
        try:
            mlp(x)
            assert calls == [b, b, b, 5]
            calls.clear()
            with use(ForwardContext(num_quant_rows=2)):
                mlp(x)
            assert calls == [3 * b + 5]
        finally:
            MLP.forward = real
