"""Weight-only quantized matmuls for decode tokens, applied to a built model from outside.

A decode step reads every weight to produce one token per sequence, so on CPU its time is the
weights' bytes over memory bandwidth; a prefill chunk does hundreds of tokens per weight read
and is bound by arithmetic, where dense float matmuls are fastest. So the rows of a step take
different paths, decided by position (decodes come first in every step, see attention.py):

    step tokens:  [ d0 d1 d2 | p0 p0 p0 p1 p1 ]
                    4-bit/8-bit weights     dense weights in the model dtype
                                            (the exact path)

A token takes the same path whatever else shares its step, so batched output equals
one-at-a-time output. Weights come from the GGUF's own blocks where the file has them: 4-bit
(Q4_0, Q4_1, Q4_K) or the q8 family (every other type: int8 integers with the file's scales,
see gguf_q8.py); any other matrix (safetensors models) is requantized to int8 per 32 with
--quantization int8, else multiplied as loaded: its float32 or bfloat16 weight read in place
by the C kernels' float kinds (NativeFloatMatmul), so that its decode rows too go through the
layers in one C call. With
int8 activations (the default) the lm_head (a tied Q8_0 embedding in both pulled models) is
requantized to 4 bits per 32 (lm_head_screen): it only picks candidates, see below. The
matmul modules live in decode_matmuls.py.

Two implementations:
- **Native** (`kernels/csrc/`, used when kernels.native.load() succeeds: a C
  compiler and AVX2/FMA; AVX-512 where the CPU has it). The 4-bit weights expand to exactly
  the file's dequantized values, int8 has one scale per 32 weights along K (a Q8_0 tensor is
  requantized exactly). Attention runs in C as well, with or without quantized decode
  (the platform's row_attention: platforms/cpu/__init__.py); with it, a step's decode rows
  go through all layers in one C call (NativeDecodeLayers). The activations are either
  - float32: decode logits agree with the dense path to float32 rounding; or
  - int8, one scale per 32 along K as llama.cpp's Q8 activations (`decode_activations`, the
    default for bf16 models where the CPU has AVX-512 VNNI, see resolve_activations): a
    third of the instructions (vpdpbusd), about 0.5 % error per matmul; decode
    log-probabilities of the default model move by up to ~0.3 against float32, and greedy
    text diverges from it after tens of tokens, as bf16 text does from float32.
  Measured on 2 Zen 5 cores, a 32-row step's 120 layer matmuls: 22.6 ms with float32
  activations, ~7 ms with int8; 36 ms with the AVX2 build.
- **torch** (`aten._weight_int4pack_mm_for_cpu`, `aten._weight_int8pack_mm`): bf16
  activations, scales rounded to bf16, int8 per output row. Its lm_head logits are bf16:
  around 20 they are 0.125 apart, so two candidates often tie exactly and the smallest token
  id would win greedy decoding whatever the model meant.

Either way the `REFINE_TOP_K` best candidates of each decode row are computed again in float32
with the dense weights (`DecodeQuantLMHead`): greedy picks, speculative verification and
reported logprobs use exact logits; the rest of the vocabulary keeps the approximate ones, which
only weigh in sampling at temperature > 0. A 4-bit screen of Gemma 3's 262k x 640 head reads
126 MB a token instead of 189 MB; over 47 steps of 8 rows its logits were off by up to 2.7
(median of the steps' worst 2.1) and the exact best token was its own best every time.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model.feed_forward import SparseMoE
from engine_core.model.forward_context import current
from engine_core.platforms.cpu.decode_matmuls import (  # noqa: F401 (the matmuls' names, kept here)
    ACT_CODES,
    ACT_DTYPE,
    Int4Matmul,
    Int8Matmul,
    NativeExperts,
    NativeFloatMatmul,
    NativeQ4Matmul,
    NativeQ8Matmul,
    c_matrices,
    c_matrix,
    requantize_int4,
    requantize_int8,
)
from engine_core.platforms.cpu.projections import mlps_of, projections
from engine_core.weights.allocator import return_freed_memory
from engine_core.weights.gguf_q4 import GROUP_SIZE, Q4Weight
from engine_core.weights.gguf_q8 import Q8Weight, cat_blocks
from kernels import native

logger = logging.getLogger(__name__)
REFINE_TOP_K = 64  # decode logits recomputed in float32 per row (see DecodeQuantLMHead)
# an lm_head of at most this many bytes stays dense for decode rows: it is read from cache,
# so a quantized screen saves no memory traffic, and its top-k and refinement cost more than
# the whole dense product (a 512 x 128 head, 256 rows: 24 ms screened, 0.5 ms dense)
DENSE_LM_HEAD_MAX_BYTES = 4 << 20
# projections built between two returns of freed heap memory (weights/allocator.py)
TRIM_EVERY = 8


@dataclass(frozen=True)
class DecodeQuantization:
    """What quantize_for_decode did, for whoever runs the model: put its decode_layers (None:
    layer by layer) and the step's decode-row count in the ForwardContext. quantized: some
    matrix multiplies 4/8-bit weights (else every one is its float weight as loaded, and the
    decode activations setting does not apply)."""

    decode_layers: NativeDecodeLayers | None
    quantized: bool = True


class DecodeQuantLinear(nn.Module):
    """A linear layer whose first input rows, as many as the forward context's
    num_quant_rows, use a quantized matmul; the rest the dense one. Without a dense weight
    (left on the meta device: load_model's prefill_weights="quantized"), every row takes the
    quantized matmul."""

    def __init__(self, dense: nn.Linear, quant: nn.Module) -> None:
        super().__init__()
        self.dense, self.quant = dense, quant
        self.quant_only = dense.weight.is_meta

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, K] -> [m, N]
        nd = x.shape[0] if self.quant_only else min(current().num_quant_rows, x.shape[0])
        if nd == 0:
            return self.dense(x.to(self.dense.weight.dtype))
        out = self.quant(x if nd == x.shape[0] else x[:nd]).to(x.dtype)  # [nd, N]
        if self.dense.bias is not None:
            out = out + self.dense.bias
        if nd == x.shape[0]:
            return out
        # x may be float32 over a bf16 model: the decode rows' hidden states from C
        return torch.cat([out, self.dense(x[nd:].to(self.dense.weight.dtype)).to(out.dtype)])


class DecodeQuantLMHead(DecodeQuantLinear):
    """The lm_head: quantized logits for decode rows, their best candidates made exact."""

    native = None  # the C kernels' library: its one-pass top-k (quantize_for_decode sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, K] -> [m, vocab] float32
        out = super().forward(x).float()
        nd = min(current().num_quant_rows, x.shape[0])
        if nd == 0:
            return out
        k = min(REFINE_TOP_K, out.shape[1])
        if self.native is not None and out.shape[1] >= native.TOPK_MAX:
            top = native.topk(self.native, out[:nd], k)  # [nd, k]
        else:
            top = out[:nd].topk(k, dim=1).indices  # [nd, k]
        w = self.dense.weight[top].float()  # [nd, k, K]
        # products and a sum per candidate: torch's bmm of these [k, K] x [K, 1] shapes took
        # 1.4 ms for 32 rows of Gemma 3 270M (one thread), this 0.2
        exact = (w * x[:nd].float().unsqueeze(1)).sum(dim=2)  # [nd, k]
        if self.dense.bias is not None:
            exact = exact + self.dense.bias.float()[top]
        out[:nd].scatter_(1, top, exact)
        return out


def in_c_kernels(linear: nn.Module) -> bool:
    """Whether a projection's decode rows multiply in the C kernels: their 4/8-bit forms or
    the float weight as loaded (the only ones pd_decode_layers and pd_moe_experts take)."""
    return (isinstance(linear, DecodeQuantLinear)
            and isinstance(linear.quant, NativeQ4Matmul | NativeQ8Matmul | NativeFloatMatmul))


class NativeDecodeLayers:
    """A step's decode rows through the decoder layers in one C call (pd_decode_layers), float32
    whatever the model dtype: no Python between a layer's operations. The model's prefill rows
    take the torch path beside it (CpuPlatform.forward splits the step)."""

    def __init__(self, model: DecoderForCausalLM, lib) -> None:
        cfg = model.config
        self.lib = lib
        self.num_heads, self.intermediate = cfg.num_heads, cfg.intermediate_size
        self.eps, self.scale = cfg.rms_norm_eps, cfg.attention_scale or cfg.head_dim**-0.5
        self._keep = []  # float32 copies the C side points into

        def f32(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            self._keep.append(t)
            return t

        def norm(module) -> int | None:  # a norm's float32 weight (offset included at load)
            return None if module is None else f32(module.weight).data_ptr()

        def ptr(t: torch.Tensor | None) -> int | None:  # a float32 copy's address, or NULL
            return None if t is None else f32(t).data_ptr()

        def moe(mlp: SparseMoE) -> native.Moe:  # the router and the shared gate in float32
            gate_up, down = mlp.decode_experts.gate_up, mlp.decode_experts.down
            shared = mlp.shared_expert
            return native.Moe(
                ptr(mlp.gate.weight), len(mlp.experts), mlp.top_k,
                int(mlp.norm_topk), 0, mlp.experts[0].intermediate, ctypes.addressof(gate_up),
                ctypes.addressof(down), shared.intermediate if shared else 0,
                c_matrix(shared.gate_up_proj) if shared else native.Matrix(),
                c_matrix(shared.down_proj) if shared else native.Matrix(),
                ptr(mlp.shared_expert_gate.weight.reshape(-1)) if shared else None,
                ptr(mlp.gate.bias))

        layers = []
        self._moes = []  # the Moe structs the layers point to
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            # Gemma's sandwich: the norm before the MLP is pre_feedforward_layernorm, and
            # post_attention_layernorm norms the attention's output
            sandwich = layer.sandwich
            experts = isinstance(mlp, SparseMoE)
            if experts:
                self._moes.append(moe(mlp))
            layers.append(native.Layer(
                norm(layer.input_layernorm),
                norm(layer.pre_feedforward_layernorm if sandwich
                     else layer.post_attention_layernorm),
                c_matrix(attn.qkv_proj), c_matrix(attn.o_proj),
                native.Matrix() if experts else c_matrix(mlp.gate_up_proj),
                native.Matrix() if experts else c_matrix(mlp.down_proj),
                attn.window or 0, norm(attn.q_norm), norm(attn.k_norm),
                norm(layer.post_attention_layernorm) if sandwich else None,
                norm(layer.post_feedforward_layernorm) if sandwich else None,
                ACT_CODES[cfg.hidden_act], int(attn.other_rope), cfg.attn_softcap or 0.0,
                cfg.swiglu_alpha, cfg.swiglu_limit, ptr(attn.sinks),
                ctypes.addressof(self._moes[-1]) if experts else None))
        self.layers = (native.Layer * len(layers))(*layers)
        self.final_norm = f32(model.norm.weight)

    @staticmethod
    def applies(model: DecoderForCausalLM) -> bool:
        """Whether pd_decode_layers computes this model: Llama's layer (with or without q/k/v
        bias, q/k norm, a window per layer, routed experts with or without a shared one in
        place of the MLP) or Gemma 3's (GeGLU, sandwich norms, a rope per kind of layer) or
        GPT-OSS's (sinks, biases, its SwiGLU), with every matmul quantized and attention in C
        on every layer; not Granite's scaled branches, nor OLMo 2's norms."""
        cfg = model.config
        if cfg.residual_multiplier != 1.0 or cfg.post_norms or cfg.qk_norm_whole:
            return False  # Granite's scaled branches, OLMo's norms: layer by layer

        def in_c(m: nn.Module, a: str) -> bool:
            return in_c_kernels(getattr(m, a))

        def mlp_in_c(mlp: nn.Module) -> bool:
            if not isinstance(mlp, SparseMoE):
                return in_c(mlp, "gate_up_proj") and in_c(mlp, "down_proj")
            shared = mlp.shared_expert  # the routed experts' C matrices: NativeExperts
            return mlp.decode_experts is not None and (shared is None or (
                in_c(shared, "gate_up_proj") and in_c(shared, "down_proj")))

        return all(layer.self_attn.row_attention is not None
                   and in_c(layer.self_attn, "qkv_proj")
                   and in_c(layer.self_attn, "o_proj") and mlp_in_c(layer.mlp)
                   for layer in model.layers)

    def __call__(self, embeddings: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta, num_layers: int, cos_sin_local: torch.Tensor | None = None,
                 ) -> torch.Tensor:  # [nd, hidden] float32, normed
        # the embedding lookup is a fresh tensor: it becomes the residual stream, in place
        h = embeddings.float().contiguous()
        nd = h.shape[0]
        local = None if cos_sin_local is None else cos_sin_local[:nd].contiguous()
        return native.decode_layers(
            self.lib, self.layers, num_layers, h, cos_sin[:nd].contiguous(), kv_cache,
            meta.slot_mapping[:nd], meta.decode_block_tables, meta.decode_context_lens,
            self.num_heads, self.intermediate, self.eps, self.scale, meta.decode_max_len,
            self.final_norm, local)


DECODE_ACTIVATIONS = ("auto", "float32", "int8")


def resolve_activations(setting: str | None, dtype: torch.dtype) -> str:
    """What the decode rows' matmuls multiply the weights with: "float32" activations, or "int8"
    ones (one scale per 32 along K, as llama.cpp's Q8 activations; the VNNI build only).
    "auto" (or None) is int8 for a bfloat16 model where the CPU has VNNI, else float32: a
    float32 model asked for full precision."""
    setting = setting or "auto"
    if setting not in DECODE_ACTIVATIONS:
        raise ValueError(f"decode_activations must be one of {', '.join(DECODE_ACTIVATIONS)}, "
                         f"got {setting!r}")
    vnni = native.has_int8(native.load())
    if setting == "int8" and not vnni:
        raise ValueError("decode_activations='int8' needs the native kernels' VNNI build (an "
                         "AVX-512 VNNI CPU and a C compiler)")
    if setting == "auto":
        return "int8" if vnni and dtype == torch.bfloat16 else "float32"
    return setting


def quantize_for_decode(
    model: DecoderForCausalLM, q4: dict[str, Q4Weight] | None = None,
    activations: str = "float32", q8: dict[str, Q8Weight] | None = None,
    lm_head_screen: str = "auto", requantize_floats: bool = True, head_in_blocks: bool = False,
) -> DecodeQuantization:
    """Give every projection and the lm_head a quantized twin for decode rows, in place.

    q4: Hugging Face-named 4-bit weights from the GGUF (see GGUFFile.q4_weights); a fused
    projection uses them when all of its parts are 4-bit.
    q8: Hugging Face-named q8-family weights from the GGUF (GGUFFile.q8_weights: Q8_0, Q5_0,
    Q5_1, Q5_K, Q6_K, Q3_K, Q2_K and the IQ types); a fused projection whose parts are all
    q4 or q8 weights, not all q4, is one q8-family matrix of their own integers and scales,
    exactly the file's values (the native kernels only). One that mixes them with float parts
    is computed as loaded (its dense weight), since a shared requantization would not be exact.
    activations: "float32" or "int8" (see resolve_activations; int8 needs the VNNI build).
    requantize_floats: float weights (safetensors, F16/BF16/F32 tensors) are requantized to
    int8 per 32 (--quantization int8); else a projection with a float part is computed as
    loaded: its float32 or bfloat16 weight multiplied in place by the C kernels
    (NativeFloatMatmul, float32 activations), or by torch without them. A float lm_head
    (head_in_blocks False: not a GGUF's block-quantized head or tied embedding) stays dense.
    lm_head_screen: "int4" (the native kernels): the lm_head, unless the file has it in 4 bits
    already, is requantized to 4 bits per 32 (requantize_int4) rather than kept as its file's
    8-bit (or requantized int8) blocks: its quantized logits only pick the REFINE_TOP_K
    candidates that are recomputed exactly, and a 262k vocabulary's head is most of a decode
    step's bytes. The rest of the vocabulary keeps the screen's logits, which enter every
    reported log-probability's normalizer: on the default model they moved by ~0.007 where
    float32 activations promise 1e-3. "int8": as every other matrix. "auto": int4 with int8
    activations (already lossy by ~0.3 in log-probability), int8 with float32 ones.
    """
    q4 = q4 or {}
    q8 = q8 or {}
    num_int4 = num_file_q8 = 0
    lib = native.load()
    int8 = activations == "int8"
    if int8 and not native.has_int8(lib):
        raise ValueError("int8 decode activations need the native kernels' VNNI build")

    def quant_for(linear: nn.Linear, parts: list[str]) -> nn.Module:
        nonlocal num_int4, num_file_q8
        if parts and all(p in q4 for p in parts):
            num_int4 += 1
            w = Q4Weight.cat([q4[p] for p in parts])
            return NativeQ4Matmul(w, lib, int8) if lib is not None else Int4Matmul(w)
        if lib is not None and parts and all(p in q4 or p in q8 for p in parts):
            num_file_q8 += 1
            w8 = cat_blocks([q8[p] if p in q8 else Q8Weight.from_q4(q4[p]) for p in parts])
            return NativeQ8Matmul(w8, lib, int8)
        if lib is not None and linear.weight.shape[1] % GROUP_SIZE == 0:
            return NativeQ8Matmul(linear.weight, lib, int8)
        return Int8Matmul(linear.weight)

    def as_loaded(linear: nn.Linear) -> NativeFloatMatmul | None:
        w = linear.weight  # the C kernels multiply a float weight in place, or torch does
        if (lib is None or w.is_meta or w.dtype not in NativeFloatMatmul.KINDS
                or not w.is_contiguous() or w.shape[1] % GROUP_SIZE):
            return None
        return NativeFloatMatmul(w, lib)

    num_float = 0
    for i, ((module, attr), parts) in enumerate(
            projections(model, q4.keys() | q8.keys()).items()):
        linear = getattr(module, attr)
        in_blocks = all(p in q4 or p in q8 for p in parts)
        # a float part beside the file's q8 parts: no exact shared requantization (see q8)
        requantize = requantize_floats and not (lib is not None and any(p in q8 for p in parts))
        if in_blocks or requantize:
            quant = quant_for(linear, parts)
        elif (quant := as_loaded(linear)) is not None:  # a float part: computed as loaded
            num_float += 1
        else:
            continue
        setattr(module, attr, DecodeQuantLinear(linear, quant))
        if i % TRIM_EVERY == TRIM_EVERY - 1:  # the parts' freed buffers back to the OS
            return_freed_memory()
    lm_head_parts = [] if model.config.tie_word_embeddings else ["lm_head.weight"]
    head = model.lm_head
    if lm_head_screen not in ("auto", "int4", "int8"):
        raise ValueError(f"lm_head_screen must be auto, int4 or int8, got {lm_head_screen!r}")
    screen4 = lm_head_screen == "int4" or (lm_head_screen == "auto" and int8)
    is_small = (not head.weight.is_meta and head.weight.numel() * head.weight.element_size()
                <= DENSE_LM_HEAD_MAX_BYTES)
    if is_small or not (requantize_floats or head_in_blocks):
        pass  # dense for every row: exact logits (cheaper than a screen for a small head)
    elif (lib is not None and screen4 and head.weight.shape[1] % GROUP_SIZE == 0
            and not all(p in q4 for p in lm_head_parts or ["-"])):
        # the head only screens candidates (DecodeQuantLMHead): half the bytes of int8
        model.lm_head = DecodeQuantLMHead(
            head, NativeQ4Matmul(requantize_int4(head.weight), lib, int8))
    else:
        model.lm_head = DecodeQuantLMHead(head, quant_for(head, lm_head_parts))
    if isinstance(model.lm_head, DecodeQuantLMHead):
        model.lm_head.native = lib
    for layer in model.layers:  # a mixture of experts' decode rows: one C call per layer
        moe = layer.mlp
        if isinstance(moe, SparseMoE) and all(
                in_c_kernels(m) for e in moe.experts for m in (e.gate_up_proj, e.down_proj)):
            cfg = model.config
            moe.decode_experts = NativeExperts(
                lib, c_matrices([e.gate_up_proj for e in moe.experts]),
                c_matrices([e.down_proj for e in moe.experts]), moe.experts[0].intermediate,
                (ACT_CODES[cfg.hidden_act], cfg.swiglu_alpha, cfg.swiglu_limit))
    # the layers in one C call need its attention: the platform's row_attention (model_ops)
    decode_layers = NativeDecodeLayers(model, lib) if NativeDecodeLayers.applies(model) else None
    matrices = [m for layer in model.layers
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                          *(p for mlp, _ in mlps_of(layer, "")
                            for p in (mlp.gate_up_proj, mlp.down_proj)))]
    total = len(matrices) + 1
    head_dense = not isinstance(model.lm_head, DecodeQuantLMHead)
    num_dense = sum(isinstance(m, nn.Linear) for m in matrices) + head_dense
    logger.info("decode rows use quantized matmuls (%s, %s activations): %d int4 weights (from "
                "the GGUF), %d q8-family weights from the GGUF, %d int8, %d float as loaded in "
                "C, %d dense", "native kernels" if lib is not None else "torch",
                activations if lib is not None else "bf16", num_int4, num_file_q8,
                total - num_int4 - num_file_q8 - num_float - num_dense, num_float, num_dense)
    quantized = num_float + num_dense < total  # some matrix in 4/8-bit blocks
    return DecodeQuantization(decode_layers, quantized)
