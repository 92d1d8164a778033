"""The supported architectures, as data: what each changes in the one decoder (decoder.py).

An architecture is looked up by its GGUF `general.architecture` or by a Hugging Face
`config.json`'s `architectures` (its `model_type` where that list is missing). Anything else
is refused with `UnsupportedArchitectureError`, which names it and the supported list: an
unknown model must never run silently with Llama's math.

What the fields change (each is read once, into ModelConfig, by the loaders):

    field               llama  mistral  qwen2  qwen3
    qkv_bias                            yes
    qk_norm                                    yes    per-head RMSNorm of q and k before rope
    sliding_window             config   config config a window when the config sets one
    gguf_permutes_qk    yes    yes                    llama.cpp's interleaved-rope row order
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


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), gguf_permutes_qk=True),
    # llama.cpp writes Mistral checkpoints as "llama"; "mistral" is the HF folder's name
    Architecture("mistral", ("MistralForCausalLM",), ("mistral",), sliding_window=True,
                 gguf_permutes_qk=True),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True, sliding_window=True),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True, sliding_window=True),
)
BY_NAME = {a.name: a for a in ARCHITECTURES}


class UnsupportedArchitectureError(ValueError):
    """A model whose architecture is not in ARCHITECTURES."""


def supported_list() -> str:
    return ", ".join(f"{a.name} ({'/'.join(a.hf_classes)})" for a in ARCHITECTURES)


def for_gguf(name: str) -> Architecture:
    """The architecture of a GGUF's `general.architecture`."""
    if name in BY_NAME:
        return BY_NAME[name]
    raise UnsupportedArchitectureError(
        f"GGUF architecture {name!r} is not supported; supported: {supported_list()}")


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
