"""GPT-OSS beyond the float32 comparison every architecture gets (test_architectures.py): as
llama.cpp writes it (a `gpt-oss` GGUF, experts in MXFP4 decoding from the file's own 4-bit
values in C), and as the released Hugging Face checkpoints hold it (experts as MXFP4 blocks and
scales)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.engine_core import tiny_models as tm
from tests.engine_core.arch_cases import CASES, check_against_hf


def gpt_oss():
    config_cls, overrides = CASES["gpt-oss"]
    return config_cls, overrides


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, K] float32 as gguf's MXFP4 blocks ([rows, K / 32 * 17] bytes) and what they
    hold (gguf's dequantization)."""
    from gguf.quants import dequantize, quantize

    raw = quantize(np.ascontiguousarray(w, dtype=np.float32), Q.MXFP4)
    return raw, np.asarray(dequantize(raw, Q.MXFP4), dtype=np.float32).reshape(w.shape)


def write_gpt_oss_gguf(hf, path, expert_type=Q.F32) -> dict[str, torch.Tensor]:
    """The model as llama.cpp's converter writes a GPT-OSS GGUF: every expert's gate and up
    de-interleaved and stacked ([experts, width, hidden]), the router as ffn_gate_inp, the
    sinks as attn_sinks, post_attention_norm, YaRN's keys; the experts' matrices in
    `expert_type`, everything else F32. Returns the transformers tensors the file holds
    (use_held_weights' input)."""
    import gguf

    cfg, arch = hf.config, "gpt-oss"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", cfg.num_hidden_layers),
                       ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size),
                       ("expert_feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim),
                       ("attention.sliding_window", cfg.sliding_window),
                       ("context_length", cfg.max_position_embeddings),
                       ("vocab_size", cfg.vocab_size), ("expert_count", cfg.num_local_experts),
                       ("expert_used_count", cfg.num_experts_per_tok),
                       ("rope.scaling.original_context_length",
                        cfg.rope_parameters["original_max_position_embeddings"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", cfg.rope_parameters["factor"])
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}
    for p in "qkvo":
        gname = "attn_output" if p == "o" else f"attn_{p}"
        names |= {f"self_attn.{p}_proj.{k}": f"{gname}.{k}" for k in ("weight", "bias")}
    held = {}
    for name, p in hf.state_dict().items():
        a = p.detach().float().numpy()
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest.startswith("mlp.experts."):
            kind = rest.removeprefix("mlp.experts.")
            if kind == "gate_up_proj":  # [E, hidden, 2 width] -> gate, up [E, width, hidden]
                parts = {"gate": a[..., 0::2], "up": a[..., 1::2]}
                back = np.empty_like(a)
                for j, (part, m) in enumerate(parts.items()):
                    m = np.ascontiguousarray(m.transpose(0, 2, 1))
                    raw, held_m = _typed(m, expert_type)
                    w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=expert_type)
                    back[..., j::2] = held_m.transpose(0, 2, 1)
                held[name] = back
            elif kind == "down_proj":  # [E, width, hidden] -> [E, hidden, width]
                raw, held_m = _typed(np.ascontiguousarray(a.transpose(0, 2, 1)), expert_type)
                w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", raw, raw_dtype=expert_type)
                held[name] = held_m.transpose(0, 2, 1)
            elif kind == "gate_up_proj_bias":
                w.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(a[:, 0::2]))
                w.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(a[:, 1::2]))
            else:
                w.add_tensor(f"blk.{layer}.ffn_down_exps.bias", a)
            continue
        gname = tm.GGUF_TOP_NAMES.get(name) or f"blk.{layer}.{names[rest]}"
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _typed(m: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """[E, rows, K] as the raw data of `qtype` ([E, rows, bytes]) and what it holds."""
    if qtype == Q.F32:
        return m, m
    raw, back = mxfp4(m.reshape(-1, m.shape[-1]))
    return raw.reshape(*m.shape[:-1], -1), back.reshape(m.shape)


def test_gguf_gpt_oss_as_llama_cpp_writes_it(tmp_path):
    """A `gpt-oss` GGUF: its sinks, biases and layer pattern read as the HF config says,
    YaRN without truncation (the model's own, which the file does not record); logits and
    greedy 48 tokens equal to transformers in float32."""
    from engine_core.weights.gguf_loader import GGUFFile

    config_cls, overrides = gpt_oss()
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    write_gpt_oss_gguf(hf, tmp_path / "m.gguf")
    cfg = GGUFFile(tmp_path / "m.gguf").model_config()
    assert (cfg.attention_sinks, cfg.o_bias, cfg.router_bias, cfg.expert_bias) == (True,) * 4
    assert cfg.hidden_act == "swiglu_oai" and cfg.sliding_layers == (True, False)
    assert cfg.rope_scaling["truncate"] is False and cfg.rope_kind == "yarn"
    check_against_hf(hf, tmp_path / "m.gguf")


def test_gguf_mxfp4_experts_decode_from_the_files_values(tmp_path):
    """GPT-OSS's experts in MXFP4, as the released GGUFs hold them: each expert's decode rows
    multiply the file's own 4-bit values and power-of-two scales in C (kind 9: 4-bit indices
    into MXFP4's table), exactly what gguf dequantizes; logits within 1e-3 of transformers
    holding the same weights, greedy equal, and on the CPU defaults (bf16, int8 activations)
    the first tokens too."""
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul
    from kernels import native

    config_cls, overrides = gpt_oss()
    hf = tm.build_hf(config_cls, tmp_path / "hf", **overrides)
    held = write_gpt_oss_gguf(hf, tmp_path / "m.gguf", Q.MXFP4)
    tm.use_held_weights(hf, held)
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    # the F32 attention requantized too (--quantization int8): every layer in one C call
    eng = tm.engine(tmp_path / "m.gguf", quantize_decode=True, decode_activations="float32",
                    quantization="int8")
    if native.load() is not None:
        for layer in eng.model.layers:
            for e in layer.mlp.experts:
                quant = e.gate_up_proj.quant
                assert isinstance(quant, NativeQ8Matmul) and quant.kind == 9
        assert eng.runner.quantization.decode_layers is not None
    assert tm.relative_error(tm.prompt_logits(eng, prompt), tm.hf_logits(hf, prompt)) < 1e-3
    assert tm.greedy(eng, [prompt], 12)[0] == tm.hf_greedy(hf, prompt, 12)
    defaults = tm.engine(tmp_path / "m.gguf", dtype="bfloat16", quantize_decode=None)
    assert defaults.runner.quantization is not None
    assert tm.greedy(defaults, [prompt], 8)[0][:2] == tm.hf_greedy(hf, prompt, 2)


def test_hf_checkpoint_with_mxfp4_experts(tmp_path):
    """The released checkpoints' experts: `gate_up_proj_blocks` [E, 2 width, hidden / 32, 16]
    of two FP4 values per byte (even index in the low nibble) and `_scales`, E8M0 exponents,
    expanded by transformers' own dequantizer at load: logits within 1e-3 and greedy equal to
    transformers holding the dequantized weights; on the CPU's quantized decode the experts
    multiply the checkpoint's own values (kind 9), with or without a dense copy for prefill
    rows (weights/hf_mxfp4.py)."""
    from safetensors.torch import load_file, save_file

    config_cls, overrides = gpt_oss()
    folder = tmp_path / "hf"
    hf = tm.build_hf(config_cls, folder, **overrides)
    state = load_file(folder / "model.safetensors")
    held = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        a = state.pop(name).float().numpy().transpose(0, 2, 1)  # [E, rows, K]
        raw, back = mxfp4(a.reshape(-1, a.shape[-1]))
        blocks = raw.reshape(*a.shape[:2], a.shape[-1] // 32, 17)
        nibbles = np.concatenate([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], axis=-1)
        state[name + "_blocks"] = torch.from_numpy(nibbles[..., 0::2] | (nibbles[..., 1::2] << 4))
        state[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
        held[name] = back.reshape(a.shape).transpose(0, 2, 1)
    save_file(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    tm.use_held_weights(hf, held)
    prompt = tm.prompts(tm.SIZES["vocab_size"], [40])[0]
    eng = tm.engine(folder)
    assert tm.relative_error(tm.prompt_logits(eng, prompt), tm.hf_logits(hf, prompt)) < 1e-3
    assert tm.greedy(eng, [prompt], 12)[0] == tm.hf_greedy(hf, prompt, 12)
    # the CPU's quantized decode: each expert's decode rows multiply the checkpoint's own
    # values in C (kind 9); with prefill_weights "quantized" the experts get no dense copy
    from engine_core.model_files import ModelSource
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul
    from engine_core.platforms.cpu.weights import dense_copy_bytes
    from kernels import native

    source = ModelSource("hf", folder)
    num = sum(w.size for w in held.values())
    assert dense_copy_bytes(source, torch.bfloat16) == 2 * num
    for prefill in ("dense", "quantized") if native.load() is not None else ("dense",):
        eng = tm.engine(folder, quantize_decode=True, decode_activations="float32",
                        prefill_weights=prefill, quantization="int8")
        for layer in eng.model.layers if native.load() is not None else ():
            for e in layer.mlp.experts:
                quant = e.gate_up_proj.quant
                assert isinstance(quant, NativeQ8Matmul) and quant.kind == 9
                assert e.down_proj.weight.is_meta == (prefill == "quantized")
        assert tm.relative_error(tm.prompt_logits(eng, prompt), tm.hf_logits(hf, prompt)) < 1e-3
        assert tm.greedy(eng, [prompt], 12)[0] == tm.hf_greedy(hf, prompt, 12)
    defaults = tm.engine(folder, dtype="bfloat16", quantize_decode=None)  # int8 activations
    assert tm.greedy(defaults, [prompt], 8)[0][:2] == tm.hf_greedy(hf, prompt, 2)
    with pytest.raises(ValueError, match="without both blocks and scales"):
        from engine_core.model.feed_forward import split_fused_experts

        list(split_fused_experts([("model.layers.0.mlp.experts.down_proj_blocks",
                                   state["model.layers.0.mlp.experts.down_proj_blocks"])]))
