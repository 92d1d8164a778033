"""Rotary position embeddings (the two-halves form, `rotate_half`), with Llama 3 and linear
scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
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
    if kind in ("default", None):
        return inv_freq
    raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3)")


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
    freq_factors: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second.

    freq_factors: a GGUF's `rope_freqs` tensor, [head_dim / 2] divisors of the frequencies
    (llama.cpp's form of Llama 3 scaling: 1 for short wavelengths, `factor` for long ones)."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def apply_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim / 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim / 2]
) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
