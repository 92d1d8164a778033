"""The model's configuration (ModelConfig, from a Hugging Face config or a GGUF's metadata mapped
to it) and dtypes; what an engine is built with besides is engine_core/engine_config.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine_core.model import architectures
from engine_core.model.architectures import hf_layer_pattern
from engine_core.model.rope_scaling import check_rope_scaling, served_positions

if TYPE_CHECKING:  # torch only where a dtype is resolved: the gateway reads configs without it
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


# the gated MLP's act(gate, up): silu(gate) * up, gelu_tanh(gate) * up, or GPT-OSS's clamped
# SwiGLU (feed_forward.GLUS)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swiglu_oai")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype by name ("bfloat16", "float32", ...) or as itself, checked. "auto" is the
    platform's to settle (engine_core/platforms/)."""
    dtypes = _dtypes()
    if isinstance(dtype, str):
        if dtype not in dtypes:
            raise ValueError(f"dtype must be one of {sorted(dtypes)} or 'auto', got {dtype!r}")
        return dtypes[dtype]
    if dtype not in dtypes.values():
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _dtypes().items() if v == dtype)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder in the architecture registry (model/architectures.py).
    The registry's fields are resolved into the flat fields below by the loaders, so the model
    reads one object."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style bias on q/k/v projections
    o_bias: bool = False  # a bias on the attention's output projection (GPT-OSS)
    # a learned logit per query head beside every softmax's scores, with no value (GPT-OSS)
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "llama"  # a name in model/architectures.py
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rope
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    # swiglu_oai's: gate * sigmoid(alpha * gate) * (up + 1), gate and up clamped by limit
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # keys a token attends to: the last sliding_window positions (itself included) on the
    # layers that slide, all of them elsewhere; None: every layer is global
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None  # per layer; None: all, when a window is set
    # GGUF `rope_freqs` (Llama 3 scaling as llama.cpp stores it): each rope frequency is
    # divided by its factor; None: no factors
    rope_freq_factors: tuple[float, ...] | None = None
    # Gemma 3 (see architectures.py): the rope base of windowed layers (None: rope_theta;
    # rope_scaling applies to the global layers only when it is set), four norms per layer,
    # embeddings times embedding_scale, norm weights stored without their + 1 (HF)
    local_rope_theta: float | None = None
    # per layer, whether it rotates q and k (SmolLM3's NoPE layers do not); None: all do
    rope_layers: tuple[bool, ...] | None = None
    # partial rotary (Phi-4-mini): rope over the first rotary_dim dimensions of each head, the
    # q and k rows reordered at load (rope.partial_rotary_order); None: the whole head
    rotary_dim: int | None = None
    rope_interleaved: bool = False  # GLM-4's pairs (2j, 2j + 1) (architectures.py)
    sandwich_norms: bool = False
    # OLMo 2 (see architectures.py): post-norms only; q and k normed over all heads at once
    post_norms: bool = False
    qk_norm_whole: bool = False
    embedding_scale: float | None = None
    norm_weight_offset: float = 0.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Gemma 2: attention scores and final logits soft-capped, cap * tanh(x / cap); None: none
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Granite: the attention and MLP outputs times residual_multiplier before they join the
    # residual stream, and the logits divided by logits_scaling
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # mixture of experts (feed_forward.SparseMoE): each token goes through the num_experts_per_tok
    # experts (of num_experts, each moe_intermediate_size wide) its router ranks highest,
    # weighted by their softmax probabilities (renormalized over the chosen ones where
    # norm_topk_prob), plus a shared expert where shared_expert_intermediate_size (Qwen2-MoE);
    # on the layers moe_layers marks (None: all); num_experts 0: a dense MLP everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] | None = None
    router_bias: bool = False  # the router's logits have a bias (GPT-OSS)
    expert_bias: bool = False  # each expert's gate, up and down projections have biases

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise ValueError(f"rope_layers has {len(self.rope_layers)} entries for "
                             f"{self.num_layers} layers")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for "
                             f"{self.num_layers} layers")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                             f"expected head_dim / 2 = {self.head_dim // 2}")
        if self.residual_multiplier <= 0 or self.logits_scaling <= 0:
            raise ValueError(f"residual_multiplier and logits_scaling must be > 0, got "
                             f"{self.residual_multiplier} and {self.logits_scaling}")
        for name in ("attn_softcap", "final_softcap"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim < self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim {self.head_dim}), "
                             f"got {self.rotary_dim}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts "
                             f"{self.num_experts}] and moe_intermediate_size > 0, got "
                             f"{self.num_experts_per_tok} and {self.moe_intermediate_size}")
        if self.moe_layers is not None and len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for "
                             f"{self.num_layers} layers")
        # an unsupported or incomplete rope_scaling fails here, before any weight is read
        check_rope_scaling(self.rotary_dim or self.head_dim, self.rope_scaling)

    @property
    def rope_kind(self) -> str | None:
        """rope_scaling's type ("linear", "llama3", "yarn", "longrope"); None: unscaled."""
        s = self.rope_scaling
        return (s.get("rope_type") or s.get("type")) if s else None

    def layer_rotates(self, layer: int) -> bool:
        """Whether layer `layer` applies rope to q and k (SmolLM3's NoPE layers do not)."""
        return self.rope_layers is None or self.rope_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it attends to every position."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or self.sliding_layers[layer]:
            return self.sliding_window
        return None

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is routed experts (feed_forward.SparseMoE)."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @property
    def has_sliding_window(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_layers))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> ModelConfig:
        """From a Hugging Face `config.json` dict of an architecture in the registry; raises
        UnsupportedArchitectureError for any other.

        The one place a ModelConfig is built: a GGUF's metadata comes here too, mapped to
        config.json's keys (weights/gguf_config.py), with what config.json has no key for
        under `gguf`: {field: value} for the ModelConfig fields in GGUF_FIELDS, each taken as
        given. Its presence also makes a stated `sliding_window` apply whatever the
        architecture (llama.cpp writes a Mistral GGUF as `llama`, whose HF configs have no
        window)."""
        arch = architectures.for_hf_config(cfg)
        _refuse_unsupported(cfg)
        gguf = dict(cfg.get("gguf") or {})
        if set(gguf) - set(GGUF_FIELDS):
            raise ValueError(f"gguf holds {sorted(set(gguf) - set(GGUF_FIELDS))}, not "
                             f"fields in {GGUF_FIELDS}")
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        window, sliding, rope_layers = hf_layer_pattern(
            cfg, replace(arch, sliding_window=True) if "gguf" in cfg else arch, num_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        bias = cfg.get("attention_bias")
        fields = dict(
            name=name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch.qkv_bias if bias is None else bool(bias),
            o_bias=arch.o_bias or bool(cfg.get("attention_out_bias")),  # (Seed-OSS's)
            attention_sinks=arch.attention_sinks,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch.name,
            qk_norm=arch.qk_norm,
            hidden_act=((cfg.get("hidden_act") or cfg.get("hidden_activation"))
                        if arch.activation_from_config else None) or arch.activation,
            swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
            swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
            sliding_window=window,
            sliding_layers=sliding if window else None,
            rope_layers=rope_layers,
            rope_interleaved=arch.rope_interleaved,
            sandwich_norms=arch.sandwich_norms,
            post_norms=arch.post_norms,
            qk_norm_whole=arch.qk_norm_whole,
            embedding_scale=(cfg["hidden_size"] ** 0.5 if arch.embedding_scale
                             else cfg.get("embedding_multiplier")),  # (Granite's)
            norm_weight_offset=arch.norm_weight_offset,
            attention_scale=(cfg["query_pre_attn_scalar"] ** -0.5
                             if cfg.get("query_pre_attn_scalar")
                             else cfg.get("attention_multiplier")),  # (Granite's)
            residual_multiplier=float(cfg.get("residual_multiplier") or 1.0),
            logits_scaling=float(cfg.get("logits_scaling") or 1.0),
            attn_softcap=cfg.get("attn_logit_softcapping") or None,
            final_softcap=cfg.get("final_logit_softcapping") or None,
            **_hf_rope(cfg, arch, head_dim),
            **_hf_experts(cfg, arch, num_layers),
        )
        return cls(**{**fields, **gguf})


# ModelConfig fields a GGUF states and config.json has no key for, which its mapping
# (weights/gguf_config.py) passes to from_hf_config under `gguf`: Llama 3's rope_freqs
# factors; the rotated width (rope.dimension_count, exact where partial_rotary_factor would
# round); whether the file holds q/k norms and router and expert biases (the tensors, where
# an HF config's architecture implies them); norms that already hold Gemma's + 1 (0); the
# windowed layers' rope base, None where no layer slides
GGUF_FIELDS = ("rope_freq_factors", "rotary_dim", "qk_norm", "router_bias", "expert_bias",
               "norm_weight_offset", "local_rope_theta")


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    """Raises ValueError for what the decoder does not compute: clamped q/k/v, MLP biases."""
    if cfg.get("clip_qkv") is not None:  # OLMo 1 and some OLMoE checkpoints
        raise ValueError(f"clip_qkv = {cfg['clip_qkv']} (q, k and v clamped) is not supported")
    for key in ("mlp_bias", "use_bias"):  # (Llama's and Seed-OSS's; ERNIE's, o_proj's too)
        if cfg.get(key):
            raise ValueError(f"{key} (biases on the MLP's projections) is not supported")


def _hf_rope(cfg: dict[str, Any], arch: architectures.Architecture,
             head_dim: int) -> dict[str, Any]:
    """ModelConfig's rope fields, and the positions served, from transformers 5's
    rope_parameters ({"rope_theta", "rope_type", ...}; Gemma 3's one block per layer type) or
    4.x's rope_theta and rope_scaling."""
    rope = dict(cfg.get("rope_parameters") or {})
    local_theta = None
    if arch.local_rope_theta is not None:
        local = rope.pop("sliding_attention", None) or {}
        rope = dict(rope.pop("full_attention", None) or rope)
        local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq")
                            or arch.local_rope_theta)
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    partial = float(rope.pop("partial_rotary_factor", None)
                    or cfg.get("partial_rotary_factor") or 1.0)
    scaling = rope or cfg.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "default":
        scaling = None
    if (scaling and scaling.get("original_max_position_embeddings") is None
            and cfg.get("original_max_position_embeddings")):  # Phi-3 states it beside
        scaling = {**scaling,
                   "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    return dict(rope_theta=float(theta), rope_scaling=scaling or None,
                max_position_embeddings=served_positions(
                    cfg.get("max_position_embeddings", 2048), scaling or None),
                local_rope_theta=local_theta,
                rotary_dim=int(head_dim * partial) if partial != 1.0 else None)


def _hf_experts(cfg: dict[str, Any], arch: architectures.Architecture,
                num_layers: int) -> dict[str, Any]:
    """ModelConfig's expert fields from a Hugging Face config: Mixtral's num_local_experts
    (its experts as wide as intermediate_size), Qwen's num_experts and moe_intermediate_size,
    with decoder_sparse_step and mlp_only_layers naming the layers that keep a dense MLP."""
    num = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not num:
        return {}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return dict(num_experts=num, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size")
                                          or cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", arch.moe_norm_topk)),
                shared_expert_intermediate_size=int(
                    cfg.get("shared_expert_intermediate_size") or 0),
                moe_layers=None if all(layers) else layers,
                router_bias=arch.moe_biases, expert_bias=arch.moe_biases)
