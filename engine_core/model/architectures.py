"""The supported architectures, as data: what each changes in the one decoder (decoder.py).

An architecture is looked up by its GGUF `general.architecture` or by a Hugging Face
`config.json`'s `architectures` (its `model_type` where that list is missing). Anything else
is refused with `UnsupportedArchitectureError`, which names it and the supported list: an
unknown model must never run silently with Llama's math.

What the fields change (each is read once, into ModelConfig, by the loaders):

    field               llama  mistral  qwen2  qwen3  gemma3  gemma2  phi3
    qkv_bias                            yes
    qk_norm                                    yes    yes                     per-head RMSNorm
    sliding_window             config   config config config  config  config  when set
    gguf_permutes_qk    yes    yes                                            llama.cpp's rope
    activation          silu   silu     silu   silu   gelu    gelu            (tanh approx.)
    sandwich_norms                                    yes     yes             after attn and MLP
    embedding_scale                                   yes     yes             times sqrt(hidden)
    norm_weight_offset                                1       1               scale by 1 + w
    local_rope_theta                                  10000                   windowed layers'

SmolLM3 leaves rope out of every 4th layer (`no_rope_layers`). Gemma 2's soft caps (attention
scores, final logits) come from its config
(`attn_logit_softcapping`, `final_logit_softcapping`; a GGUF's `gemma2.*_softcapping`).

Phi-3 holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, the decoder's own fused
matrices, in both formats (a GGUF's `attn_qkv` and its `ffn_up` of twice the width).

Granite scales the embeddings (`embedding_multiplier`), attention scores
(`attention_multiplier`, in place of head_dim^-0.5), the attention and MLP outputs before they
join the residual stream (`residual_multiplier`) and divides the logits (`logits_scaling`);
llama.cpp writes them as `granite.embedding_scale`, `.attention.scale`, `.residual_scale` and
`.logit_scale`.

OLMo 2 norms only the attention's and the MLP's outputs, before each joins the residual
stream (no norm before either), and its q and k norms span all heads at once; OLMo 3 is OLMo
2 with windowed layers (`layer_types`), whose rope keeps the base without the config's
scaling. llama.cpp writes OLMo 2 without reordering Q and K. OLMoE is Llama's layer (pre-norms)
with OLMo's q/k norms and routed experts. EXAONE 4 is OLMo 2's layer with per-head q/k norms,
three windowed layers to one global, and rope left out of the global ones. Seed-OSS is Llama
with q/k/v biases. GLM-4 is Gemma's four-norm layer with SiLU, q/k/v biases and rope over
half of each head in interleaved pairs; ERNIE 4.5 is Llama with rope over the whole head in
interleaved pairs. Those four and OLMo 3 are served from their folders only (`gguf=False`).

GraniteMoE is Granite's multipliers on Mixtral's layer, its experts stacked per layer in the
checkpoint.

Mixtral, Qwen2-MoE and Qwen3-MoE replace the MLP with routed experts (feed_forward.SparseMoE):
Mixtral is Mistral's layer, Qwen2-MoE Qwen2's with a gated shared expert beside the routed
ones, Qwen3-MoE Qwen3's. llama.cpp writes Mixtral as `llama` with an expert count.

GPT-OSS is Qwen2's layer with routed experts and four additions: a learned attention sink per
head (the softmax of every query head has exp(sink) beside its scores, with no value), biases
on o_proj, the router and the experts, and a clamped SwiGLU,
gate * sigmoid(1.702 gate) * (up + 1) with gate <= 7 and |up| <= 7.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    name: str  # the GGUF `general.architecture`
    hf_classes: tuple[str, ...]  # Hugging Face `architectures` entries
    hf_model_types: tuple[str, ...]  # Hugging Face `model_type` values
    qkv_bias: bool = False  # q/k/v projections carry a bias
    qk_norm: bool = False  # RMSNorm over head_dim on every q and k head, before rope
    sliding_window: bool = False  # honours the config's sliding_window (None: global)
    # llama.cpp's converter reorders the rows of Q and K for its interleaved rope; these
    # architectures' GGUFs hold that order, which the loader undoes (the others use the
    # two-halves rope in both formats)
    gguf_permutes_qk: bool = False
    activation: str = "silu"  # of the gated MLP's gate
    # Gemma: four norms per layer (input, post-attention, pre- and post-feedforward), the
    # attention and MLP outputs normed before they join the residual stream
    sandwich_norms: bool = False
    # OLMo 2: no norm before the attention or the MLP; their outputs are normed before they
    # join the residual stream (post_attention_layernorm, post_feedforward_layernorm)
    post_norms: bool = False
    # OLMo 2: q and k RMS-normed over all their heads at once, not head by head
    qk_norm_whole: bool = False
    embedding_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    # Gemma's HF RMSNorm scales by (1 + weight); its GGUF norms already hold the + 1
    norm_weight_offset: float = 0.0
    # the rope base of sliding-window layers where it differs from the global one (Gemma 3;
    # llama.cpp's GGUF does not store it)
    local_rope_theta: float | None = None
    # GGUF tensor names that mean something else in this architecture than in Llama's
    gguf_layer_names: tuple[tuple[str, str], ...] = ()
    # which layers slide when a GGUF says only the window (llama.cpp's fixed pattern: every
    # n-th layer is global), or an HF config has no `layer_types` (one written before
    # transformers 5: its `sliding_window_pattern`, else this); 0: all of them
    global_every: int = 0
    # every n-th layer attends without rope (SmolLM3's NoPE layers: 4), where an HF config has
    # no `no_rope_layers` list and in a GGUF (llama.cpp fixes the step); 0: rope everywhere
    nope_every: int = 0
    # EXAONE 4: where the model has windowed layers, its global ones attend without rope
    nope_global: bool = False
    # GLM-4: its rope turns the pairs (2j, 2j + 1) of the rotated dimensions, not (j, j + d/2)
    rope_interleaved: bool = False
    # HF tensor names (after `model.layers.N.`) that mean one of ours, as (theirs, ours)
    hf_layer_names: tuple[tuple[str, str], ...] = ()
    # whether its GGUF form (llama.cpp's names, Q/K order, layer pattern) is known here; False:
    # served from its Hugging Face folder only, a GGUF refused by name
    gguf: bool = True
    # mixture of experts (where the config or GGUF has experts): whether the top-k routing
    # weights are renormalized to sum to 1, where the config does not say (`norm_topk_prob`)
    # and in a GGUF (llama.cpp fixes it per architecture)
    moe_norm_topk: bool = True
    # GPT-OSS: attention sinks (a learned logit per head in each softmax), a bias on o_proj,
    # on the router and on every expert's projections, and its own clamped SwiGLU whatever
    # the config's hidden_act says; its checkpoint holds each layer's experts as 3-D tensors,
    # gate and up interleaved (feed_forward.split_fused_experts)
    attention_sinks: bool = False
    o_bias: bool = False
    moe_biases: bool = False
    activation_from_config: bool = True
    fused_experts: bool = False
    # GraniteMoE: each layer's experts stacked as input_linear / output_linear, its router as
    # router.layer (feed_forward.split_stacked_experts)
    stacked_experts: bool = False
    # YaRN's ramp between whole dimensions (transformers' `truncate`, llama.cpp's only way);
    # GPT-OSS was trained without the rounding, which its GGUF does not record
    yarn_truncate: bool = True

    def our_name(self, name: str) -> str:
        """A checkpoint tensor's name (without `model.`) with this architecture's own layer
        part renamed to ours (hf_layer_names: GLM-4's norms); any other name as it is."""
        if not self.hf_layer_names or not name.startswith("layers."):
            return name
        layer, _, rest = name.removeprefix("layers.").partition(".")
        ours = dict(self.hf_layer_names).get(rest)
        return name if ours is None else f"layers.{layer}.{ours}"


# Gemma's four norms per layer, as llama.cpp names them
_GEMMA_GGUF_NAMES = (("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
                     ("post_attention_norm.weight", "post_attention_layernorm.weight"),
                     ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"))

# OLMo 2's two norms per layer, as llama.cpp names them (it writes no attn_norm or ffn_norm)
_OLMO2_GGUF_NAMES = (("post_attention_norm.weight", "post_attention_layernorm.weight"),
                     ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"))

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), gguf_permutes_qk=True),
    # llama.cpp writes Mistral checkpoints as "llama"; "mistral" is the HF folder's name
    Architecture("mistral", ("MistralForCausalLM",), ("mistral",), sliding_window=True,
                 gguf_permutes_qk=True),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True, sliding_window=True),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True, sliding_window=True),
    # the text-only model; Gemma3ForConditionalGeneration (vision) is not supported
    Architecture("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), qk_norm=True,
                 sliding_window=True, activation="gelu_pytorch_tanh", sandwich_norms=True,
                 embedding_scale=True, norm_weight_offset=1.0, local_rope_theta=10000.0,
                 gguf_layer_names=_GEMMA_GGUF_NAMES, global_every=6),
    # Gemma 2: Gemma 3's layer without q/k norm or a local rope base, every other layer
    # windowed, attention scores and final logits soft-capped (read from the config)
    Architecture("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), sliding_window=True,
                 activation="gelu_pytorch_tanh", sandwich_norms=True, embedding_scale=True,
                 norm_weight_offset=1.0, gguf_layer_names=_GEMMA_GGUF_NAMES,
                 global_every=2),
    # SmolLM3: Llama with every 4th layer's rope left out (a GGUF: llama.cpp's Llama order)
    Architecture("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), sliding_window=True,
                 gguf_permutes_qk=True, nope_every=4),
    # Phi-3 and Phi-4 (which keeps Phi3ForCausalLM); LongRoPE (Phi-3 128k, Phi-3.5) and
    # partial rotary (Phi-4-mini) are refused where the loaders read the config
    Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), sliding_window=True,
                 gguf_layer_names=(("attn_qkv.weight", "self_attn.qkv_proj.weight"),
                                   ("ffn_up.weight", "mlp.gate_up_proj.weight"))),
    # OLMo 2: norms after the attention and the MLP only, q and k normed over all heads at
    # once; OLMo 3 adds windowed layers (its config's layer_types), whose rope is unscaled
    Architecture("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), qk_norm=True, qk_norm_whole=True,
                 post_norms=True, gguf_layer_names=_OLMO2_GGUF_NAMES),
    Architecture("olmo3", ("Olmo3ForCausalLM",), ("olmo3",), qk_norm=True, qk_norm_whole=True,
                 post_norms=True, sliding_window=True, local_rope_theta=500000.0, gguf=False),
    # Granite (3.x dense): Llama with four multipliers from its config (embeddings,
    # attention scale, residual branches, logits)
    Architecture("granite", ("GraniteForCausalLM",), ("granite",), gguf_permutes_qk=True),
    # mixtures of experts (feed_forward.SparseMoE); a Mixtral GGUF says `llama`
    Architecture("mixtral", ("MixtralForCausalLM",), ("mixtral",), sliding_window=True,
                 gguf_permutes_qk=True),
    Architecture("qwen2moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), qkv_bias=True,
                 sliding_window=True, moe_norm_topk=False),
    # GraniteMoE (3.x MoE): Granite's four multipliers on Mixtral's layer
    Architecture("granitemoe", ("GraniteMoeForCausalLM",), ("granitemoe",), stacked_experts=True,
                 gguf=False),
    Architecture("qwen3moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qk_norm=True,
                 sliding_window=True),
    # EXAONE 4: OLMo 2's post-norms with Qwen3's per-head q/k norms; three windowed layers
    # to one global, which leaves rope out (the 1.2B: no window, rope everywhere)
    Architecture("exaone4", ("Exaone4ForCausalLM",), ("exaone4",), qk_norm=True,
                 post_norms=True, sliding_window=True, global_every=4, nope_global=True,
                 gguf=False),
    # GLM-4 (0414): Gemma's four norms under its own names, q/k/v biases, gate and up fused,
    # rope over half of each head in interleaved pairs
    Architecture("glm4", ("Glm4ForCausalLM",), ("glm4",), qkv_bias=True, sandwich_norms=True,
                 rope_interleaved=True, gguf=False, hf_layer_names=(
                     ("post_self_attn_layernorm.weight", "post_attention_layernorm.weight"),
                     ("post_attention_layernorm.weight", "pre_feedforward_layernorm.weight"),
                     ("post_mlp_layernorm.weight", "post_feedforward_layernorm.weight"))),
    # ERNIE 4.5 (dense): Llama with rope over the whole head in interleaved pairs
    Architecture("ernie4_5", ("Ernie4_5ForCausalLM",), ("ernie4_5",), rope_interleaved=True,
                 gguf=False),
    # Seed-OSS: Llama with q/k/v biases (and o_proj's, where attention_out_bias says so)
    Architecture("seed_oss", ("SeedOssForCausalLM",), ("seed_oss",), qkv_bias=True,
                 gguf=False),
    # OLMoE: Llama's layer with OLMo's q/k norms across heads and routed experts (top-k
    # weights not renormalized unless the config says so)
    Architecture("olmoe", ("OlmoeForCausalLM",), ("olmoe",), qk_norm=True, qk_norm_whole=True,
                 moe_norm_topk=False),
    # GPT-OSS: every other layer windowed (its config's layer_types; a GGUF's fixed pattern
    # starts windowed), YaRN rope, 4 of 32 or 128 experts per token
    Architecture("gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), qkv_bias=True,
                 sliding_window=True, activation="swiglu_oai", global_every=2,
                 attention_sinks=True, o_bias=True, moe_biases=True,
                 activation_from_config=False, fused_experts=True, yarn_truncate=False,
                 gguf_layer_names=(
                     ("post_attention_norm.weight", "post_attention_layernorm.weight"),
                     ("attn_sinks.weight", "self_attn.sinks"),
                     ("attn_output.bias", "self_attn.o_proj.bias"),
                     ("ffn_gate_inp.bias", "mlp.gate.bias"),
                     ("ffn_gate_exps.bias", "mlp.experts.{}.gate_proj.bias"),
                     ("ffn_up_exps.bias", "mlp.experts.{}.up_proj.bias"),
                     ("ffn_down_exps.bias", "mlp.experts.{}.down_proj.bias"))),
)
BY_NAME = {a.name: a for a in ARCHITECTURES}


class UnsupportedArchitectureError(ValueError):
    """A model whose architecture is not in ARCHITECTURES."""


def supported_list(gguf: bool = False) -> str:
    """The architectures (those with a GGUF form, for `gguf`), with their HF classes."""
    return ", ".join(f"{a.name} ({'/'.join(a.hf_classes)})" for a in ARCHITECTURES
                     if a.gguf or not gguf)


def for_gguf(name: str) -> Architecture:
    """The architecture of a GGUF's `general.architecture`."""
    arch = BY_NAME.get(name)
    if arch is not None and arch.gguf:
        return arch
    why = ("is served from its Hugging Face folder only: its GGUF form (llama.cpp's tensor "
           "names, Q/K order and layer pattern) is not checked here" if arch is not None
           else "is not supported")
    raise UnsupportedArchitectureError(
        f"GGUF architecture {name!r} {why}; supported: {supported_list(gguf=True)}")


def for_hf_config(cfg: dict[str, Any]) -> Architecture:
    """The architecture of a Hugging Face config.json: its `architectures`, else its
    `model_type`."""
    classes = cfg.get("architectures") or []
    for a in ARCHITECTURES:
        if any(c in a.hf_classes for c in classes):
            return a
    model_type = cfg.get("model_type")
    if not classes:
        for a in ARCHITECTURES:
            if model_type in a.hf_model_types:
                return a
    named = "/".join(classes) or f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"Hugging Face architecture {named} is not supported; supported: {supported_list()}")


def hf_layer_pattern(cfg: dict[str, Any], arch: Architecture, num_layers: int
                     ) -> tuple[int | None, tuple[bool, ...] | None, tuple[bool, ...] | None]:
    """(sliding window, which layers slide, which layers rotate q and k) from an HF config:
    None where every layer does (or no window)."""
    window, sliding = None, None
    if (arch.sliding_window and cfg.get("sliding_window")
            and cfg.get("use_sliding_window") is not False):
        window = int(cfg["sliding_window"])
        if cfg.get("layer_types"):  # transformers 5 names the layers that slide
            sliding = tuple(t == "sliding_attention" for t in cfg["layer_types"])
            if not any(sliding):
                window, sliding = None, None
        elif arch.global_every:  # an older config: every n-th layer is global ("LLLG": 4)
            pattern = cfg.get("sliding_window_pattern") or arch.global_every
            every = len(pattern) if isinstance(pattern, str) else int(pattern)
            sliding = tuple((i + 1) % every != 0 for i in range(num_layers))
    rope_layers = None
    if arch.nope_every:  # 1: the layer rotates (SmolLM3's no_rope_layers)
        if cfg.get("no_rope_layers"):
            rope_layers = tuple(bool(x) for x in cfg["no_rope_layers"])
        else:
            every = int(cfg.get("no_rope_layer_interval") or arch.nope_every)
            rope_layers = tuple((i + 1) % every != 0 for i in range(num_layers))
    if arch.nope_global and sliding is not None:  # EXAONE 4: its global layers are NoPE
        rope_layers = sliding
    return window, sliding, rope_layers
