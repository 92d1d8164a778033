"""Every architecture in the registry against transformers, on tiny random models built from
a config inside the test (no download), float32: prompt logits within 1e-3 relative and greedy
48-token continuations equal, with chunked prefill and a shared prefix (prefix caching) in the
same batch, and prompts longer than the sliding window where there is one."""

from __future__ import annotations

import json

import pytest
import torch

from engine_core.model.architectures import UnsupportedArchitectureError
from engine_core.platforms.cpu.decode_quant import DecodeQuantization
from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import CASES, GEMMA3_AS_GGUF, check_against_hf, transformers


@pytest.mark.parametrize("case", CASES)
def test_tiny_model_matches_transformers(case, tmp_path):
    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    check_against_hf(hf, tmp_path)


def test_config_fields_from_the_registry(tmp_path):
    from engine_core.weights.safetensors_loader import load_hf_config

    for case, want in [("qwen2", dict(attention_bias=True, qk_norm=False)),
                       ("qwen3", dict(attention_bias=False, qk_norm=True)),
                       ("mistral-window", dict(sliding_window=12)),
                       ("mistral-global", dict(sliding_window=None)),
                       ("llama3-rope", dict(rope_theta=10000.0)),
                       ("gemma3", dict(rope_theta=1e6, local_rope_theta=10000.0,
                                       sliding_layers=(True, False, True), sliding_window=12,
                                       sandwich_norms=True, embedding_scale=8.0, qk_norm=True,
                                       attention_scale=24**-0.5, norm_weight_offset=1.0,
                                       hidden_act="gelu_pytorch_tanh",
                                       tie_word_embeddings=True))]:
        folder = tmp_path / case
        config_cls, overrides = CASES[case]
        config_cls(**{**tm.SIZES, **overrides}).save_pretrained(str(folder))
        cfg = load_hf_config(folder)
        for k, v in want.items():
            assert getattr(cfg, k) == v, (case, k)
    assert load_hf_config(tmp_path / "llama3-rope").rope_scaling["rope_type"] == "llama3"


def test_generation_config_adds_its_end_of_sequence_ids(tmp_path):
    """A chat model's generation_config.json lists more end-of-sequence ids than its
    config.json (Llama 3 Instruct's <|eot_id|>, GPT-OSS's <|call|>): both count, config.json's
    first."""
    import json

    from engine_core.weights.safetensors_loader import load_hf_config

    transformers.LlamaConfig(**{**tm.SIZES, "eos_token_id": 2}).save_pretrained(str(tmp_path))
    assert load_hf_config(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 9]}))
    assert load_hf_config(tmp_path).eos_token_ids == (2, 5, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_hf_config(tmp_path).eos_token_ids == (2, 7)


def test_gemma2_soft_caps_and_layer_pattern(tmp_path):
    """Gemma 2's caps are in play (the model without them answers otherwise), its layers
    alternate local and global from transformers 5's layer_types, from an older config's
    sliding_window_pattern, and from a GGUF, which carries the caps too; a GGUF of the 27B's
    46 layers scales attention by (hidden / heads) ** -0.5, as llama.cpp does."""
    from engine_core.weights.gguf_loader import GGUFFile
    from engine_core.weights.safetensors_loader import load_hf_config

    config_cls, overrides = CASES["gemma2"]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    cfg = load_hf_config(tmp_path / "hf")
    assert (cfg.attn_softcap, cfg.final_softcap) == (1.5, 4.0)
    assert [cfg.layer_window(i) for i in range(3)] == [12, None, 12]
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    uncapped = tm.build_hf(config_cls, tmp_path / "uncapped", **{
        **overrides, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert tm.relative_error(tm.prompt_logits(tm.engine(tmp_path / "hf"), prompt),
                             tm.hf_logits(uncapped, prompt)) > 0.05
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    del raw["layer_types"]  # written before transformers 5
    raw["sliding_window_pattern"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path / "hf").sliding_layers == (True, False, True)

    tm.write_gguf(hf, tmp_path / "m.gguf", arch="gemma2", permute=False)
    g = GGUFFile(tmp_path / "m.gguf").model_config()
    assert (g.attn_softcap, g.final_softcap, g.attention_scale) == (1.5, 4.0, None)
    assert g.sliding_layers == (True, False, True) and g.local_rope_theta is None
    big = tm.build_hf(config_cls, tmp_path / "big", **{**overrides, "num_hidden_layers": 46,
                                                        "hidden_size": 48})
    tm.write_gguf(big, tmp_path / "big.gguf", arch="gemma2", permute=False)
    assert GGUFFile(tmp_path / "big.gguf").model_config().attention_scale == 12 ** -0.5


def test_smollm3_leaves_rope_out_of_its_nope_layers(tmp_path):
    """SmolLM3's fourth layer rotates nothing (the model with rope there answers otherwise),
    from transformers 5's no_rope_layers, an older config's no_rope_layer_interval and a
    GGUF (llama.cpp's fixed step of 4, Q/K in its Llama order)."""
    from engine_core.weights.gguf_loader import GGUFFile
    from engine_core.weights.safetensors_loader import load_hf_config

    config_cls, overrides = CASES["smollm3"]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    assert load_hf_config(tmp_path / "hf").rope_layers == (True, True, True, False)
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    everywhere = tm.build_hf(config_cls, tmp_path / "rope", **{**overrides,
                                                               "no_rope_layers": [1] * 4})
    assert tm.relative_error(tm.prompt_logits(tm.engine(tmp_path / "hf"), prompt),
                             tm.hf_logits(everywhere, prompt)) > 0.05
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    del raw["no_rope_layers"]
    raw["no_rope_layer_interval"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(tmp_path / "hf").rope_layers == (True, False, True, False)
    tm.write_gguf(hf, tmp_path / "m.gguf", arch="smollm3")
    assert GGUFFile(tmp_path / "m.gguf").model_config().rope_layers == (True, True, True, False)
    check_against_hf(hf, tmp_path / "m.gguf")


def test_gguf_phi3_with_its_fused_matrices(tmp_path):
    """Phi-3 as llama.cpp writes it: attn_qkv and a double-width ffn_up, the window under
    phi3.attention.sliding_window; greedy and logits equal to transformers past the window,
    in float32 and on the CPU defaults (4-bit decode straight from a Q4_0 file's fused blocks)."""
    from gguf import GGMLQuantizationType

    from engine_core.weights.gguf_loader import GGUFFile

    config_cls, overrides = CASES["phi3"]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    tm.write_gguf(hf, tmp_path / "m.gguf", arch="phi3", permute=False)
    f = GGUFFile(tmp_path / "m.gguf")
    cfg = f.model_config()
    assert (cfg.architecture, cfg.sliding_window, cfg.head_dim) == ("phi3", 12, 16)
    assert "model.layers.0.self_attn.qkv_proj.weight" in f.tensor_types()
    check_against_hf(hf, tmp_path / "m.gguf")
    held = tm.write_gguf(hf, tmp_path / "q.gguf", arch="phi3", permute=False,
                         qtype=GGMLQuantizationType.Q4_0)
    tm.use_held_weights(hf, held)
    eng = tm.engine(tmp_path / "q.gguf", quantize_decode=True, decode_activations="float32")
    qkv = eng.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant).__name__ in ("NativeQ4Matmul", "Int4Matmul")  # the file's blocks
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    assert tm.greedy(eng, [prompt], 4)[0][:2] == tm.hf_greedy(hf, prompt, 2)


def test_qwen2_sliding_window_follows_layer_types(tmp_path):
    """Qwen2 slides only when use_sliding_window is set, and only on layers from
    max_window_layers on."""
    from engine_core.config import ModelConfig

    base = {**tm.SIZES, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 12}
    off = ModelConfig.from_hf_config({**base, "use_sliding_window": False}, "q")
    assert off.sliding_window is None
    cfg = transformers.Qwen2Config(**{**tm.SIZES, "use_sliding_window": True,
                                      "sliding_window": 12, "max_window_layers": 1})
    on = ModelConfig.from_hf_config({**cfg.to_dict(), "architectures": ["Qwen2ForCausalLM"]},
                                    "q")
    assert [on.layer_window(i) for i in range(2)] == [None, 12]


def test_unknown_hf_architecture_is_refused(tmp_path):
    from engine_core.model_files import ModelSource
    from engine_core.model_loader import load_model
    from engine_core.platforms import select_platform

    hf = tm.build_hf(transformers.LlamaConfig, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["PhiForCausalLM"]
    cfg["model_type"] = "phi"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="PhiForCausalLM.*supported: llama"):
        load_model(ModelSource("hf", tmp_path), torch.float32, select_platform("cpu"))
    assert hf is not None


def test_unknown_gguf_architecture_is_refused(tmp_path):
    from engine_core.weights.gguf_loader import GGUFFile

    hf = tm.build_hf(transformers.LlamaConfig, tmp_path)
    tm.write_gguf(hf, tmp_path / "m.gguf", arch="phi2")
    with pytest.raises(UnsupportedArchitectureError,
                       match="'phi2' is not supported; supported: llama .*phi3"):
        GGUFFile(tmp_path / "m.gguf")


def test_gguf_qwen3_unpermuted_with_qk_norm(tmp_path):
    hf = tm.build_hf(transformers.Qwen3Config, tmp_path)
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    tm.write_gguf(hf, gguf_dir / "m.gguf", arch="qwen3", permute=False)
    check_against_hf(hf, gguf_dir / "m.gguf")


def test_gguf_mistral_written_as_llama_keeps_its_window(tmp_path):
    """llama.cpp writes Mistral as `llama`; where the file says `llama.attention.sliding_window`,
    every layer slides, and prompts longer than the window match transformers."""
    from engine_core.weights.gguf_loader import GGUFFile

    hf = tm.build_hf(transformers.MistralConfig, tmp_path, sliding_window=12)
    path = tmp_path / "m.gguf"
    tm.write_gguf(hf, path, arch="llama", extra={"llama.attention.sliding_window": 12})
    cfg = GGUFFile(path).model_config()
    assert cfg.sliding_window == 12 and cfg.sliding_layers is None
    check_against_hf(hf, path)


def test_gguf_gemma3_as_llama_cpp_writes_it(tmp_path):
    """llama.cpp's Gemma 3 GGUF: norms already + 1, its own norm names, head_dim as
    key_length, the window without a layer pattern (every 6th layer is global), the local
    rope base not stored (10000), attention scaled by head_dim ** -0.5."""
    hf = tm.build_hf(transformers.Gemma3TextConfig, tmp_path, **GEMMA3_AS_GGUF)
    assert hf.config.layer_types[4:] == ["sliding_attention", "full_attention"]
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    tm.write_gguf(hf, gguf_dir / "m.gguf", arch="gemma3", permute=False)
    check_against_hf(hf, gguf_dir / "m.gguf")


@pytest.mark.parametrize("case", ["mistral-window", "qwen2", "qwen3", "gemma3", "gemma3-mqa",
                                  "gemma2", "smollm3", "phi3"])
def test_one_call_c_decode_layers(case, tmp_path):
    """Where the C kernels load, every layer's attention runs in them (windowed ones with
    their window), and the decode rows of Llama-style layers, with q/k/v bias, q/k norm or a
    window, and of Gemma 3's (GeGLU, sandwich norms, local layers' own rope base, scaled
    embeddings and attention) and Gemma 2's (soft-capped scores), go through all layers in one
    C call (pd_decode_layers),
    giving the tokens the layer-by-layer path gives with the same quantized weights."""
    from kernels import native

    if native.load() is None:
        pytest.skip("the C kernels do not load here")
    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    eng = tm.engine(tmp_path, quantize_decode=True, quantization="int8")
    window = overrides.get("sliding_window")
    types = overrides.get("layer_types") or (
        hf.config.layer_types if case == "gemma2"
        else ["sliding_attention"] * hf.config.num_hidden_layers)
    windows = [window if t == "sliding_attention" else None for t in types]
    assert [layer.self_attn.window for layer in eng.model.layers] == windows
    assert all(layer.self_attn.row_attention is not None for layer in eng.model.layers)
    assert eng.runner.quantization.decode_layers is not None
    layers = eng.runner.quantization.decode_layers.layers
    assert [layer.window for layer in layers] == [w or 0 for w in windows]
    cap = overrides.get("attn_logit_softcapping") or 0.0  # Gemma 2's cap, in every C layer
    assert [layer.softcap for layer in layers] == [cap] * len(windows)
    gemma3, gemma = case.startswith("gemma3"), case.startswith("gemma")
    assert all(bool(layer.q_norm) == (case == "qwen3" or gemma3) for layer in layers)
    assert all(bool(layer.attn_out_norm) == bool(layer.mlp_out_norm) == (layer.act == 1) == gemma
               for layer in layers)
    nope = [not r for r in getattr(hf.config, "no_rope_layers", [1] * len(windows))]
    assert [layer.local_rope for layer in layers] == [int(gemma3 and w is not None or n)
                                                      for w, n in zip(windows, nope, strict=True)]
    prompts = tm.prompts(tm.SIZES["vocab_size"], [40, 9, 70])
    assert tm.relative_error(tm.prompt_logits(eng, prompts[0]),
                             tm.hf_logits(hf, prompts[0])) < 1e-3
    one_call = tm.greedy(eng, prompts, 32)
    eng.runner.quantization = DecodeQuantization(decode_layers=None)  # layer by layer
    assert tm.greedy(eng, prompts, 32) == one_call


@pytest.mark.parametrize("case", ["mistral-window", "gemma3"])
def test_windowed_model_through_the_kv_handoff(case, tmp_path):
    """A prompt longer than the window prefilled on one engine, its KV moved block by block
    into another (tests/engine_core/test_handoff.py's handoff), decoded there: the tokens
    equal a colocated run's and transformers'."""
    from types import SimpleNamespace

    from engine_core.sampling_params import SamplingParams
    from tests.engine_core.test_handoff import handoff

    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    prompt = tm.prompts(tm.SIZES["vocab_size"], [70])[0]
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
    prefill = SimpleNamespace(engine=tm.engine(tmp_path, enable_prefix_caching=False))
    decode = SimpleNamespace(engine=tm.engine(tmp_path))
    got, num_cached = handoff(prefill, decode, prompt, params, "h-0")
    assert num_cached == 0
    assert got == tm.greedy(tm.engine(tmp_path), [prompt], 24)[0] == tm.hf_greedy(hf, prompt, 24)


GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
              "gemma2": "gemma2", "smollm3": "smollm3", "phi3": "phi3", "olmo2": "olmo2"}


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("case", GGUF_ARCHS)
def test_gguf_in_every_type_gguf_writes(case, qtype, tmp_path):
    """Each architecture written as GGUF in each type the gguf package produces, with
    llama.cpp's conventions (permuted Q/K for llama, Gemma's norms + 1): prompt logits
    match transformers running the weights the file holds (dequantized by gguf)."""
    from gguf import GGMLQuantizationType

    config_cls, overrides = CASES[case]
    if case == "gemma3":
        overrides = GEMMA3_AS_GGUF
    elif case == "gemma2":  # a GGUF scales attention by head_dim (the 27B aside)
        overrides = {**overrides, "query_pre_attn_scalar": tm.SIZES["head_dim"]}
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    path = tmp_path / "m.gguf"
    held = tm.write_gguf(hf, path, arch=GGUF_ARCHS[case], qtype=GGMLQuantizationType[qtype],
                         permute=case in ("llama", "smollm3"))
    tm.use_held_weights(hf, held)
    eng = tm.engine(path)
    for p in tm.prompts(tm.SIZES["vocab_size"], [9, 40]):
        assert tm.relative_error(tm.prompt_logits(eng, p), tm.hf_logits(hf, p)) < 1e-3


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen2-yarn", "qwen3", "mistral-window",
                                  "gemma3", "gemma2", "smollm3", "phi3", "mixtral",
                                  "qwen2-moe", "qwen3-moe", "granite", "gpt-oss", "olmo2",
                                  "olmo3", "olmoe", "exaone4", "seed-oss", "glm4",
                                  "ernie4_5", "granitemoe"])
def test_int8_quantization_runs_every_architecture(case, tmp_path):
    """--quantization int8 on the CPU (float weights requantized for the decode matmuls, C
    kernels where they apply) on every architecture: it runs, and the first token (from the
    dense prefill) and the next few (int8 decode weights, refined top candidates) follow
    transformers."""
    config_cls, overrides = CASES[case]
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    eng = tm.engine(tmp_path, quantize_decode=None, quantization="int8")
    assert eng.runner.quantization is not None
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    got = tm.greedy(eng, [prompt], 8)[0]
    assert len(got) == 8
    assert got[:2] == tm.hf_greedy(hf, prompt, 2)


@pytest.mark.parametrize("case", ["qwen2-yarn", "gemma2", "smollm3", "phi3", "qwen2-moe",
                                  "qwen3-moe", "gpt-oss", "olmo2", "olmo3", "olmoe",
                                  "exaone4", "seed-oss", "glm4", "ernie4_5", "granitemoe"])
def test_user_defaults_run_the_newer_architectures(case, tmp_path):
    """The configuration a user gets on this CPU with bfloat16 weights (LLMEngine's own
    choices, nothing forced): the float weights computed as loaded in every row: prompt logits
    within bf16's reach of transformers' own bf16 run (GPT-OSS: its float32 run), and its
    first token."""
    config_cls, overrides = CASES[case]
    if case == "gemma2":  # its real caps: the test's 1.5 and 4 turn bf16 noise into errors
        overrides = {**overrides, "attn_logit_softcapping": 50.0,
                     "final_logit_softcapping": 30.0}
    hf = tm.build_hf(config_cls, tmp_path, **overrides)
    # float32 is the reference for GPT-OSS (transformers' bf16 takes its attention softmax in
    # bf16, 28 % off its float32 logits here) and OLMoE (its top two first tokens, 0.045
    # apart in float32, tie in transformers' bf16 run)
    if case not in ("gpt-oss", "olmoe"):
        hf = hf.to(torch.bfloat16)
    eng = tm.engine(tmp_path, dtype="bfloat16", quantize_decode=None)
    assert eng.dtype == torch.bfloat16
    quantization = eng.runner.quantization  # nothing in blocks: the floats as loaded
    assert quantization is None or not quantization.quantized
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    ours, theirs = tm.prompt_logits(eng, prompt), tm.hf_logits(hf, prompt).float()
    assert tm.relative_error(ours, theirs) < 0.05
    got = tm.greedy(eng, [prompt], 8)[0]
    assert len(got) == 8 and got[0] == int(theirs[-1].argmax())


def test_gguf_granite_with_its_multipliers(tmp_path):
    """Granite as llama.cpp writes it (Llama's Q/K order, the multipliers as
    granite.embedding_scale, .attention.scale, .residual_scale and .logit_scale): logits and
    greedy equal to transformers."""
    from engine_core.weights.gguf_loader import GGUFFile

    config_cls, overrides = CASES["granite"]
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    tm.write_gguf(hf, tmp_path / "m.gguf", arch="granite", extra={
        "granite.embedding_scale": 2.0, "granite.attention.scale": 0.2,
        "granite.residual_scale": 0.5, "granite.logit_scale": 3.0})
    cfg = GGUFFile(tmp_path / "m.gguf").model_config()
    assert (cfg.embedding_scale, cfg.attention_scale, cfg.residual_multiplier,
            cfg.logits_scaling) == pytest.approx((2.0, 0.2, 0.5, 3.0))
    check_against_hf(hf, tmp_path / "m.gguf")

