"""Rotary position embeddings (the two-halves form, `rotate_half`), with Llama 3, linear, YaRN
and LongRoPE scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine_core.model.rope_scaling import (
    attention_factor,
    check_rope_scaling,
    yarn_factor,
)


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                    long: bool = True) -> torch.Tensor:
    """long: LongRoPE's long factors, else its short ones (see uses_long_factors)."""
    check_rope_scaling(head_dim, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
        smooth = ((old_len / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
        return torch.where(wavelen < old_len / high, inv_freq, out)
    if kind == "yarn":
        return _yarn_inv_frequencies(inv_freq, head_dim, theta, scaling)
    if kind == "longrope":  # Phi-3 128k, Phi-3.5: each frequency divided by its own factor
        factors = scaling["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float64)
    return inv_freq  # "default"


def _yarn_inv_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float,
                          scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as transformers computes it: frequencies that turn fewer than
    beta_slow times over the original context are divided by `factor` (interpolated), those
    that turn more than beta_fast times are kept, with a linear ramp over the dimensions
    between."""
    factor = yarn_factor(scaling)
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
    freq_factors: tuple[float, ...] | None = None, long: bool = True,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second.

    freq_factors: a GGUF's `rope_freqs` tensor, [head_dim / 2] divisors of the frequencies
    (llama.cpp's form of Llama 3 scaling: 1 for short wavelengths, `factor` for long ones).
    long: LongRoPE's factor set (uses_long_factors).
    rotary_dim: partial rotary (Phi-4-mini): the frequencies of a rope over rotary_dim
    dimensions, then cos 1 and sin 0 (no rotation, no attention factor) for the rest: with q
    and k rows in partial_rotary_order, rotate_half pairs exactly the dimensions the model's
    own rope pairs, and leaves the others as they are."""
    rot = rotary_dim or head_dim
    inv_freq = inv_frequencies(rot, theta, scaling, long)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # [max_positions, rot / 2]
    factor = attention_factor(scaling, max_positions)
    still = torch.zeros(max_positions, (head_dim - rot) // 2, dtype=torch.float64)
    table = torch.cat([freqs.cos() * factor, still + 1, freqs.sin() * factor, still], dim=-1)
    return table.float()


def partial_rotary_rows(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                        rotary_dim: int, interleaved: bool = False) -> torch.Tensor | None:
    """The row order (partial_rotary_order per head) of the q/k projection named `name` (HF
    names: q_proj, k_proj, the fused qkv_proj of Phi-3, weight or bias) or of a q/k norm's
    weight; None for any other tensor."""
    order = partial_rotary_order(head_dim, rotary_dim, interleaved)

    def heads(n: int, start: int = 0) -> torch.Tensor:
        return (start + torch.arange(n)[:, None] * head_dim + order).reshape(-1)

    proj = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if proj == "q_proj":
        return heads(num_heads)
    if proj == "k_proj":
        return heads(num_kv_heads)
    if proj in ("q_norm", "k_norm"):
        return order
    if proj == "qkv_proj":
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        return torch.cat([heads(num_heads), heads(num_kv_heads, q), q + kv + torch.arange(kv)])
    return None


def partial_rotary_order(head_dim: int, rotary_dim: int,
                         interleaved: bool = False) -> torch.Tensor:
    """[head_dim] source index of each dimension of a q or k head, for partial rotary: the
    model rotates pairs (i, i + rotary_dim / 2) of its first rotary_dim dimensions (interleaved:
    GLM-4's pairs (2i, 2i + 1)); reordered, they become the pairs (j, j + head_dim / 2) that
    rotate_half takes, with the dimensions that do not rotate in the remaining slots. q and k
    alike, so every q . k is unchanged."""
    half_rot, half_rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first, second = (torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)) \
        if interleaved else (torch.arange(half_rot), torch.arange(half_rot, rotary_dim))
    rest = torch.arange(rotary_dim, head_dim)
    return torch.cat([first, rest[:half_rest], second, rest[half_rest:]])


def apply_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim / 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim / 2]
) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
