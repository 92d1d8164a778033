"""Read a Hugging Face model folder: config.json and *.safetensors shards."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from engine_core.config import ModelConfig

if TYPE_CHECKING:  # safetensors gives torch tensors; the gateway reads load_hf_config only
    import torch


def load_hf_config(folder: Path) -> ModelConfig:
    """config.json's ModelConfig, with the end-of-sequence ids of generation_config.json
    added where the folder has one: transformers' generate stops at those, and chat models
    list more there than in config.json (Llama 3 Instruct's <|eot_id|>, GPT-OSS's <|call|>)."""
    cfg = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf_config(cfg, name=cfg.get("_name_or_path") or folder.name)
    generation = folder / "generation_config.json"
    if not generation.exists():
        return config
    eos = json.loads(generation.read_text()).get("eos_token_id")
    more = eos if isinstance(eos, list) else [] if eos is None else [eos]
    ids = tuple(dict.fromkeys([*config.eos_token_ids, *(int(i) for i in more)]))
    return dataclasses.replace(config, eos_token_ids=ids)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, st.get_tensor(name)
