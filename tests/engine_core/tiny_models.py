"""Tiny random models built by transformers from a config (no download), saved as safetensors
or written as GGUF with llama.cpp's conventions, and the helpers that compare our engine with
them. The engine runs on token ids (LoadConfig(load_tokenizer=False)): a random model has no
vocabulary worth tokenizing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as _Q

from engine_core.engine import LLMEngine
from engine_core.engine_config import CacheConfig, DeviceConfig, LoadConfig, SchedulerConfig
from engine_core.kv_cache.layout import KVLayout
from engine_core.model.attention import AttentionMetadata
from engine_core.sampling_params import SamplingParams

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)


def build_hf(config_cls, folder: Path, seed: int = 0, **overrides):
    """A random transformers model of `config_cls` saved to `folder`; returns it (float32,
    eager attention: the reference). Weights are drawn wider than transformers' default so
    that logits are spread and greedy choices are not near-ties."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = config_cls(**{**SIZES, **overrides})
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15 if "embed" not in name else 1.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:  # biases
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    return model.eval()


def engine(path: Path, block_size: int = 8, max_num_batched_tokens: int = 2048,
           quantize_decode: bool = False, decode_activations: str | None = None,
           device: str | torch.device = "cpu", max_model_len: int | None = None,
           dtype: str = "float32", prefill_weights: str = "auto",
           quantization: str | None = None, **kw) -> LLMEngine:
    return LLMEngine(
        LoadConfig(model=str(path), dtype=dtype, load_tokenizer=False,
                   quantize_decode=quantize_decode, decode_activations=decode_activations,
                   quantization=quantization, prefill_weights=prefill_weights),
        DeviceConfig(device=device),
        cache_config=CacheConfig(block_size=block_size, num_blocks=96, **kw),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_model_len=max_model_len,
                                         max_num_batched_tokens=max_num_batched_tokens),
    )


def greedy(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of n tokens, all requests in one batch; min_tokens blocks EOS
    exactly as transformers' min_new_tokens does."""
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    ids = [eng.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [list(done[i]) for i in ids]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones_like(ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()


def prompt_logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position from one prefill into a fresh paged cache whose block
    table is a permutation (paging exercised, not just contiguous memory). On the host."""
    layout: KVLayout = eng.layout
    bs = layout.block_size
    num_blocks = -(-len(ids) // bs)
    kv = layout.allocate(num_blocks + 3, eng.device)
    table = torch.randperm(num_blocks + 3, generator=torch.Generator().manual_seed(0))
    table = table[:num_blocks].to(torch.int32)
    pos = torch.arange(len(ids))
    meta = AttentionMetadata(
        slot_mapping=table[pos // bs].long() * bs + pos % bs,
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=table[None],
        prefill_query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
    )
    meta = AttentionMetadata(**{f.name: _to(getattr(meta, f.name), eng.device)
                                for f in dataclasses.fields(meta)})
    with torch.inference_mode():
        hidden = eng.model(torch.tensor(ids, device=eng.device), pos.to(eng.device), kv, meta)
        return eng.model.compute_logits(hidden).cpu()


def _to(x, device: torch.device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# -- GGUF ------------------------------------------------------------------------------------
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Phi-3's fused matrices, as llama.cpp names them
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    # mixtures of experts: the router, the stacked experts (transformers holds gate and up
    # as one [experts, 2 * width, hidden] tensor), a shared expert and its gate
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                  "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


# Gemma's four norms per layer, as llama.cpp names them
GEMMA_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(hf: str, post_norm_names: bool = False) -> str:
    """llama.cpp's name of a tensor; post_norm_names: Gemma's and OLMo 2's norm names."""
    if hf in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[hf]
    parts = hf.removeprefix("model.layers.").split(".", 1)
    names = {**GGUF_LAYER_NAMES, **GEMMA_LAYER_NAMES} if post_norm_names else GGUF_LAYER_NAMES
    return f"blk.{parts[0]}.{names[parts[1]]}"


def use_held_weights(hf_model, held: dict[str, np.ndarray]) -> None:
    """The transformers model's weights replaced by what a GGUF holds (write_gguf's return,
    after quantization): the reference for a quantized file."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name in held:
                p.copy_(torch.from_numpy(held[name]))


def _split_experts(state: dict[str, torch.Tensor]):
    """The state dict's items with transformers' fused experts' gate_up_proj ([experts,
    2 * width, hidden]) as two tensors, `experts.gate_proj` and `experts.up_proj`, as
    llama.cpp stores them."""
    for name, p in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = p.chunk(2, dim=1)
            yield name.removesuffix("gate_up_proj") + "gate_proj", gate
            yield name.removesuffix("gate_up_proj") + "up_proj", up
        else:
            yield name, p


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows (two halves -> interleaved pairs per head)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# the IQ types pdserve reads (gguf dequantizes them; it writes none of them)
IQ_TYPES = (_Q.IQ4_NL, _Q.IQ4_XS, _Q.IQ2_XXS, _Q.IQ2_XS, _Q.IQ2_S, _Q.IQ3_XXS, _Q.IQ3_S,
            _Q.IQ1_S)


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes] raw blocks of a type that gguf can read but not write (the K-quants, the
    IQ types): random quants, grid indices and sub-block scales, with the f16 block scales
    (d, dmin) set small and finite, so weights land near transformers' init. Offsets of d/dmin
    within each block are those of llama.cpp's block structs."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    d_at = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
    d_at = {**dict.fromkeys(IQ_TYPES, (0,)), **d_at}
    # each type's largest |integer x sub-scale| is about 1 / scale: |w| stays below ~0.5
    scale = {Q.Q2_K: 2e-3, Q.Q3_K: 2e-3, Q.Q4_K: 2e-3, Q.Q5_K: 1e-3, Q.Q6_K: 1e-4,
             Q.IQ4_NL: 2e-3, Q.IQ4_XS: 1e-4, Q.IQ2_XXS: 2e-3, Q.IQ2_XS: 2e-3, Q.IQ2_S: 2e-3,
             Q.IQ3_XXS: 1e-3, Q.IQ3_S: 1e-3, Q.IQ1_S: 1e-2}[qtype]
    for off in d_at[qtype]:
        f = rng.uniform(0.5, 1.5, (rows, cols // block)).astype(np.float16) * np.float16(scale)
        data[..., off:off + 2] = f.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def write_gguf(hf_model, path: Path, arch: str = "llama", qtype=None, permute: bool = True,
               rope_freqs: np.ndarray | None = None, extra: dict | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> dict:
    """Write `hf_model` as a GGUF of architecture `arch`: 2-D weights in `qtype` (default F32;
    a K-quant or IQ type gets random blocks, see random_blocks), 1-D ones in F32, Q/K permuted as
    llama.cpp does for llama; for gemma2/3 its norm names, and norms holding the + 1; for
    olmo2 and exaone4 the same norm names. Returns {HF name: float32 weight the file holds}:
    what a loader must read back, for building the reference."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    cfg = hf_model.config
    qtype = qtype or Q.F32
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    if f"{arch}.rope.dimension_count" not in (extra or {}):  # extra may narrow it
        w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_float32(f"{arch}.rope.freq_base", rope.get("full_attention", rope)["rope_theta"])
    gemma = arch in ("gemma3", "gemma2")
    post_norm_names = gemma or arch in ("olmo2", "exaone4")  # post_attention_norm, post_ffw_norm
    if gemma:
        w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    if arch == "gemma2":  # llama.cpp writes Gemma 2's soft caps
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    elif arch == "phi3" and cfg.sliding_window:  # llama.cpp writes Phi-3's window
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    for key in ("bos", "eos"):  # min_tokens blocks EOS as transformers' min_new_tokens does
        token = getattr(hf_model.generation_config, f"{key}_token_id")
        if isinstance(token, int):
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", token)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:  # as llama.cpp writes them (Mixtral: experts as wide as the MLP)
        w.add_uint32(f"{arch}.expert_count", experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                         cfg.shared_expert_intermediate_size)
    for k, v in (extra or {}).items():  # by the value's type: string, float32 or uint32
        add = {str: w.add_string, float: w.add_float32}.get(type(v), w.add_uint32)
        add(k, v)
    held = {}
    unwritable = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, *IQ_TYPES}
    stacked = {}  # transformers' fused experts' gate/up: written apart, held together
    for i, (name, p) in enumerate(_split_experts(hf_model.state_dict())):
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = p.detach().float().numpy()
        if name.endswith("shared_expert_gate.weight"):
            a = a.reshape(-1)  # llama.cpp's vector
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's converter stores Gemma's norms with the + 1
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = permute_qk(a, cfg.num_attention_heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = permute_qk(a, cfg.num_key_value_heads)
        t = qtype if a.ndim >= 2 else Q.F32
        # gguf writes every type but the K-quants and IQ types, which get random blocks; a
        # stack of experts as one matrix of all their rows
        rows, cols = int(np.prod(a.shape[:-1])), a.shape[-1]
        raw = (random_blocks(t, rows, cols, seed=i) if t in unwritable
               else quantize(a.reshape(rows, cols), t))
        raw = raw.reshape(*a.shape[:-1], raw.shape[-1])
        # raw: [..., bytes per row]
        w.add_tensor(gguf_name(name, post_norm_names), raw, raw_dtype=t)
        back = np.asarray(dequantize(raw, t), dtype=np.float32).reshape(a.shape)
        if name.endswith(("experts.gate_proj", "experts.up_proj")):
            stacked.setdefault(name.rsplit(".", 1)[0] + ".gate_up_proj", []).append(back)
            continue
        held[name] = back.reshape(p.shape)
    for name, (gate, up) in stacked.items():
        held[name] = np.concatenate([gate, up], axis=1)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32), raw_dtype=Q.F32)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a.astype(np.float32), raw_dtype=Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    out = {}
    for name, a in held.items():  # undo the permutation: the reference's own row order
        proj = name.split(".")[-2]
        if permute and proj in heads:
            n = heads[proj]
            a = a.reshape(n, a.shape[0] // n // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if gemma and name.endswith("norm.weight"):
            a = a - 1.0
        out[name] = a
    return out
