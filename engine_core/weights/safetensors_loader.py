"""Read a Hugging Face model folder: config.json and *.safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine_core.config import ModelConfig


def load_hf_config(folder: Path) -> ModelConfig:
    cfg = json.loads((folder / "config.json").read_text())
    return ModelConfig.from_hf_config(cfg, name=cfg.get("_name_or_path") or folder.name)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, st.get_tensor(name)
