"""Rope scaling's configuration, without torch: which scalings are supported and what they
need (check_rope_scaling), the context a scaled model serves and its attention factor. The
frequencies themselves are rope.py's."""

from __future__ import annotations

import math
from typing import Any


def check_rope_scaling(head_dim: int, scaling: dict[str, Any] | None) -> None:
    """ValueError for a rope_scaling that rope.inv_frequencies cannot compute."""
    if not scaling:
        return
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "yarn":
        yarn_factor(scaling)
        if "original_max_position_embeddings" not in scaling:
            raise ValueError("rope_scaling 'yarn' needs original_max_position_embeddings")
    elif kind == "longrope":
        for key in ("long_factor", "short_factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ValueError(f"rope_scaling 'longrope' needs {key}")
        for key in ("long_factor", "short_factor"):
            if len(scaling[key]) != head_dim // 2:
                raise ValueError(f"rope_scaling 'longrope' has {len(scaling[key])} factors for "
                                 f"a rope over {head_dim} dimensions (partial rotary is not "
                                 f"supported)")
    elif kind not in ("linear", "llama3", "default", None):
        raise ValueError(f"rope_scaling type {kind!r} is not supported ({', '.join(SCALINGS)})")


SCALINGS = ("linear", "llama3", "yarn", "longrope")


def uses_long_factors(scaling: dict[str, Any] | None, served_len: int) -> bool:
    """LongRoPE's choice, made once for the engine as llama.cpp makes it (by the context it
    serves): the long factors when it serves more than the original context. transformers
    chooses per forward by the sequence's length and recomputes the cache when a sequence
    crosses over; within the original context on a short-context engine, and past it on a
    long-context one, the two agree."""
    return served_len > int(scaling["original_max_position_embeddings"]) if scaling else True


def yarn_factor(scaling: dict[str, Any]) -> float:
    factor = scaling.get("factor")
    if factor is None:
        raise ValueError("rope_scaling 'yarn' needs a factor")
    return float(factor)


def attention_factor(scaling: dict[str, Any] | None, max_positions: int = 0) -> float:
    """The factor on cos and sin (so on every attention logit, twice): YaRN's
    0.1 ln(factor) + 1, LongRoPE's sqrt(1 + ln(factor) / ln(original context)) (factor:
    max_positions over the original context where the config gives none), unless the config
    states it; 1 for every other scaling."""
    kind = (scaling.get("rope_type") or scaling.get("type")) if scaling else None
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or max_positions / original)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = yarn_factor(scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return m(factor, float(mscale)) / m(factor, float(mscale_all_dim))
    return m(factor)


def served_positions(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The positions a model serves: YaRN stretches its original context by `factor` (as
    vLLM derives it; Qwen's configs keep max_position_embeddings at the original length)."""
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "yarn" \
            and scaling.get("original_max_position_embeddings"):
        stretched = int(float(scaling["original_max_position_embeddings"]) * yarn_factor(scaling))
        return max(max_position_embeddings, stretched)
    return max_position_embeddings
