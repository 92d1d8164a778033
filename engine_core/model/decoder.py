"""The decoder of every architecture in the registry (architectures.py) as plain single-device
code over a flattened, varlen batch. The architectures differ in fields of ModelConfig (q/k/v
bias, q/k norm, sliding window per layer, rope scaling), not in subclasses.

`forward` takes the step's tokens of many sequences at once (decode tokens and prefill chunks
mixed, see attention.py) and reads/writes the paged KV cache. Quantization, compilation and
parallelism are applied from outside.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import ModelConfig
from engine_core.model import architectures
from engine_core.model.attention import AttentionMetadata, paged_attention
from engine_core.model.feed_forward import (
    MLP,
    SparseMoE,
    moe_name,
    split_fused_experts,
    split_stacked_experts,
)
from engine_core.model.forward_context import current
from engine_core.model.ops import ModelOps
from engine_core.model.rope import apply_rope, cos_sin_cache, partial_rotary_rows
from engine_core.model.rope_scaling import uses_long_factors


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused=None) -> None:
        """fused: the platform's fused (add +) RMSNorm (ModelOps.rms_norm), or None."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual stream: (norm(residual + x), residual + x).

        The fused kernel adds into `residual` in place: the stream belongs to the forward.
        """
        if self.fused is not None:
            if residual is None:
                return self.fused(x, None, self.weight, self.eps)
            return self.fused(residual, x, self.weight, self.eps), residual
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 like the reference implementation, then scale in the model dtype
        if x.dtype == torch.float32:  # one fused op: per-op overhead dominates small batches
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # fused too (a third of the time of the separate ops on 2,048 bf16 rows), rounded to
        # the model dtype before the weight as the reference does
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: ModelOps) -> None:
        super().__init__()
        self.ops = ops
        # rope, K/V store and attention in one call per kind of row (the CPU's C kernels)
        self.row_attention = ops.row_attention
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matrix product
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.window = cfg.layer_window(layer)  # None: attends to every earlier position
        self.softcap = cfg.attn_softcap  # Gemma 2's cap on the attention scores; None: none
        # GPT-OSS: each query head's sink logit joins its softmax's denominator; None: none
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None
        # rotates with the model's other rope rows (DecoderForCausalLM.other_rope): Gemma 3's
        # local layers (their own base), SmolLM3's NoPE layers (no rotation)
        self.other_rope = ((cfg.local_rope_theta is not None and self.window is not None)
                           or not cfg.layer_rotates(layer))
        # Qwen3: every q and k head RMS-normalised over head_dim before rope; OLMo 2: q and k
        # each over all their heads at once
        self.qk_norm_whole = cfg.qk_norm_whole
        q_width, k_width = (self.q_size, self.kv_size) if cfg.qk_norm_whole \
            else (cfg.head_dim, cfg.head_dim)
        norm = ops.rms_norm  # as pd_decode_layers normalises q and k
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, norm) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: torch.Tensor,  # [num_tokens, head_dim] float32: cos | sin of each position
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        nd = meta.num_decode_tokens
        # float32 for the kernels (the parameter follows the model's dtype)
        sinks = None if self.sinks is None else self.sinks.float().contiguous()
        if self.row_attention is None or not kv_layer.is_contiguous():
            return self.o_proj(self._attention(qkv, cos_sin, kv_layer, meta,
                                               nd if meta.decodes_done else 0, sinks))
        # rope, K/V store and attention in one call (the C kernels), in float32 over a
        # float32 or bfloat16 cache: each row over its own context, decode rows and prefill
        # rows alike (one call for each kind). Rows here are the prefill rows only when
        # decodes_done. bfloat16 rows go in as they are (converted in the kernel).
        rows = qkv.contiguous() if qkv.dtype == torch.bfloat16 else qkv.float()  # f32: rotated
        first = 0 if meta.decodes_done else nd  # this call's first prefill row
        parts = []
        if first:
            parts.append(self.row_attention(
                rows[:nd], cos_sin[:nd], kv_layer, meta.slot_mapping[:nd],
                meta.decode_block_tables, meta.decode_context_lens, self.num_heads, self.scale,
                meta.decode_max_len, window=self.window, softcap=self.softcap, sinks=sinks,
            ))
        if first < rows.shape[0]:
            parts.append(self.row_attention(
                rows[first:], cos_sin[first:], kv_layer, meta.slot_mapping[nd:],
                meta.prefill_block_tables, meta.prefill_row_lens, self.num_heads, self.scale,
                meta.prefill_max_len, meta.prefill_row_tables, self.window, self.softcap, sinks,
            ))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.to(qkv.dtype))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:  # [n, q_size + 2 * kv_size]
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            return torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v],
                             dim=-1)
        # [n * heads, head_dim], contiguous for the C norm (one KV head's reshape is a view)
        q = self.q_norm(q.reshape(n * self.num_heads, self.head_dim).contiguous())
        k = self.k_norm(k.reshape(n * self.num_kv_heads, self.head_dim).contiguous())
        return torch.cat([q.reshape(n, -1), k.reshape(n, -1), v], dim=-1)

    def _attention(self, qkv, cos_sin, kv_layer, meta, skip_decodes: int,
                   sinks: torch.Tensor | None) -> torch.Tensor:
        """The torch path over rows skip_decodes.. of the step (all of them, or its prefills)."""
        n = qkv.shape[0]
        half = self.head_dim // 2
        cos_sin = cos_sin.to(qkv.dtype)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads rotate together: one rope over [n, heads + kv_heads, head_dim]
        qk = apply_rope(qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim),
                        cos_sin[:, None, :half], cos_sin[:, None, half:])
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_layer, meta, self.scale, self.ops, skip_decodes,
                              self.window, self.softcap, sinks)
        return out.reshape(n, self.q_size)  # [n, heads * head_dim]


class DecoderLayer(nn.Module):
    """Llama's layer (pre-norms), or with cfg.sandwich_norms Gemma's: the attention and MLP
    outputs are normed again before they join the residual stream; or with cfg.post_norms
    OLMo 2's: only those two norms.

        llama:  r += attn(in_norm(r));            r += mlp(post_attn_norm(r))
        gemma:  r += post_attn_norm(attn(in_norm(r)));  r += post_ffw_norm(mlp(pre_ffw_norm(r)))
        olmo2:  r += post_attn_norm(attn(r));     r += post_ffw_norm(mlp(r))
    """

    def __init__(self, cfg: ModelConfig, layer: int, ops: ModelOps) -> None:
        super().__init__()
        self.post_norms = cfg.post_norms
        norm = ops.rms_norm  # the norms pd_decode_layers fuses (Gemma's other two stay torch's)
        if not self.post_norms:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm)
        self.self_attn = Attention(cfg, layer, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm)
        self.mlp = SparseMoE(cfg, ops.grouped_experts) if cfg.layer_is_moe(layer) else MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1 elsewhere
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos_sin, kv_layer, meta):
        """(this layer's output, the residual stream before it); the stream is None for the
        first layer, whose input x is the embedding."""
        if self.post_norms:  # the stream itself enters the attention and the MLP
            h = x if residual is None else x + residual
            h = h + self.post_attention_layernorm(self.self_attn(h, cos_sin, kv_layer, meta))
            return self.post_feedforward_layernorm(self.mlp(h)), h
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, kv_layer, meta)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x),
                                                         residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (x * self.residual_multiplier if self.residual_multiplier != 1.0 else x), residual


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelOps) -> None:
        """ops: the kernels its modules call, as the platform that builds it chose them."""
        super().__init__()
        self.config = cfg
        # no random init: load_weights fills it (nn.Embedding's normal_ under the meta device
        # of model_loader imports torch._dynamo, ~1.5 s of every start)
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        # windowed layers' rope where their base differs (Gemma 3); empty: they use cos_sin
        self.register_buffer("cos_sin_local", torch.empty(0), persistent=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_rope(self, device: torch.device, served_len: int | None = None) -> None:
        """served_len: the longest sequence the engine serves (None: the model's whole
        context), which picks LongRoPE's factors (rope.uses_long_factors)."""
        cfg = self.config
        long = uses_long_factors(cfg.rope_scaling if cfg.rope_kind == "longrope" else None,
                                 served_len or cfg.max_position_embeddings)
        self.cos_sin = cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
            cfg.rope_freq_factors, long, cfg.rotary_dim,
        ).to(device)
        if cfg.local_rope_theta is not None:
            self.cos_sin_local = cos_sin_cache(
                cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None
            ).to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:
            # scaled in the model dtype, as the reference does
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_layers, num_blocks, 2, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        num_layers: int | None = None,  # run only the first layers (a self-speculative draft)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The step's ForwardContext (forward_context.py) says which leading rows are decode
        rows (the quantized matmuls' rows) and who watches the layers. Every row goes through
        the layers here; the CPU platform's runner may take the decode rows through all of
        them in one C call first (platforms/cpu/decode_quant.NativeDecodeLayers) and pass the
        prefill rows alone (meta.decodes_done)."""
        x = self.embed(input_ids)
        residual = None
        cos_sin = self.cos_sin[positions]  # [num_tokens, head_dim] float32
        local = self.other_rope(positions, cos_sin)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        on_layer_done = current().on_layer_done
        for i, layer in enumerate(layers):
            rope = local if layer.self_attn.other_rope else cos_sin
            x, residual = layer(x, residual, rope, kv_cache[i], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.norm(x, residual)[0]

    def other_rope(self, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor | None:
        """The rope rows of the layers with `other_rope`: Gemma 3's local base, or cos 1 and
        sin 0 (rotating nothing, exactly) for SmolLM3's NoPE layers; None: no such layer."""
        if self.cos_sin_local.numel():
            return self.cos_sin_local[positions]
        if self.config.rope_layers is not None:
            rows = torch.zeros_like(cos_sin)
            rows[:, : self.config.head_dim // 2] = 1.0
            return rows
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        if isinstance(self.lm_head, nn.Linear):  # decode rows from the C kernels: float32
            hidden = hidden.to(self.lm_head.weight.dtype)
        logits = self.lm_head(hidden).float()
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: softcap * tanh(logits / softcap), in float32
            logits = cap * torch.tanh(logits / cap)
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     absent: Iterable[str] = ()) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up on the way. `absent`:
        names whose weights stay unloaded on purpose (their parameter on the meta device: the
        quantized matmuls hold them, see model_loader), counted as loaded."""
        params = dict(self.named_parameters())
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {  # HF suffix -> (our suffix, row offset)
            "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q), "v_proj": ("qkv_proj", q + kv),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", None),  # half-way
        }
        parts_of = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),  # a checkpoint's fused matrix
                    "gate_up_proj": ("gate_proj", "up_proj")}  # (Phi-3) counts as its parts
        loaded: set[str] = set()
        arch = architectures.BY_NAME[cfg.architecture]
        if arch.fused_experts:  # GPT-OSS: one per expert
            absent = set(absent)
            weights = split_fused_experts(weights, skip=absent)
        elif arch.stacked_experts:  # GraniteMoE: likewise
            weights = split_stacked_experts(weights)
        for name, w in itertools.chain(((n, None) for n in absent), weights):
            name = moe_name(arch.our_name(name.removeprefix("model.")))
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                ours, offset = fused[parts[-2]]
                target = ".".join([*parts[:-2], ours, parts[-1]])
                if offset is None:  # up_proj: after gate_proj (an MLP's or expert's width)
                    offset = params[target].shape[0] // 2
                if w is not None:
                    params[target][offset : offset + w.shape[0]].copy_(w)
                loaded.add(f"{target}:{parts[-2]}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            if w is not None:
                if cfg.norm_weight_offset and name.endswith("norm.weight"):
                    w = w + cfg.norm_weight_offset  # HF Gemma's norms scale by 1 + weight
                if params[name].shape != w.shape:
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(w.shape)}, expected "
                        f"{tuple(params[name].shape)}"
                    )
                params[name].copy_(w)
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in parts_of and parts[-1] == "weight":
                loaded.update(f"{name}:{p}" for p in parts_of[parts[-2]])
            else:
                loaded.add(name)
        if cfg.rotary_dim is not None or cfg.rope_interleaved:  # q and k rows reordered
            for name, p in params.items():  # into rotate_half's pairs
                rows = partial_rotary_rows(name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                           cfg.rotary_dim or cfg.head_dim, cfg.rope_interleaved)
                if rows is not None and name.startswith("layers."):
                    p.copy_(p[rows])
        # per layer: 2 norms, q, k, v, o (+ q, k, v biases) (+ q, k norms) (+ Gemma's pre-
        # and post-feedforward norms); the MLP's gate, up, down, or the experts': a router,
        # gate, up and down per expert (+ a shared expert's three and its gate)
        # (+ o's bias and the sinks) (+ the router's bias and each expert's three biases)
        per_layer = (6 + (3 if cfg.attention_bias else 0) + (2 if cfg.qk_norm else 0)
                     + (2 if cfg.sandwich_norms else 0) + cfg.o_bias + cfg.attention_sinks)
        moe = (1 + cfg.router_bias + 3 * cfg.num_experts * (2 if cfg.expert_bias else 1)
               + (4 if cfg.shared_expert_intermediate_size else 0))
        expected = (sum(per_layer + (moe if cfg.layer_is_moe(i) else 3)
                        for i in range(cfg.num_layers))
                    + 2 + (0 if cfg.tie_word_embeddings else 1))
        if len(loaded) != expected:
            raise ValueError(f"loaded {len(loaded)} weight tensors, expected {expected}")
