"""How kernels/csrc becomes a shared library: found prebuilt, or compiled once under a lock.

    kernels/csrc/*.c --cc -O3 -mavx2 -mfma [-mavx512f ...] -fopenmp-->
        <dir>/cpu_decode-<isa>-<source key>-<compiler key>.so

The source key hashes every file of kernels/csrc and the build's flags; the compiler key hashes
the compiler's identity (the first line of `cc --version` and `cc -dumpmachine`), so a new or
upgraded compiler builds anew. The compiler is $CC (it may carry arguments, "ccache gcc"), or
else cc or gcc on PATH.

`build(dir, isa)` with a compiler returns the library of the exact key, compiling it first if
it is missing. Without a compiler (a runtime image) it returns a library of the same source key
built by whichever compiler, so a library built in an image's build stage is found; only when
there is none does it raise NoCompilerError.

A compile runs under an exclusive flock of `<target>.lock` beside the target: of several
processes starting together one compiles, the others wait for the lock and find the finished
library. The output is written under a temporary name and renamed, so no one loads a
half-written file. The compiler runs in its own process group, killed whole once it runs past
the timeout (PDSERVE_NATIVE_BUILD_TIMEOUT seconds, default 300); a library already there is
used without taking the lock, so a read-only directory of prebuilt libraries works.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"  # every .c there, one library; cpu_kernels.h shared
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
ISA_FLAGS = {"avx2": [], "avx512": AVX512, "avx512vnni": [*AVX512, "-mavx512vnni"]}
LIBS = ["-lm"]
PREFIX = "cpu_decode"
TIMEOUT_ENV = "PDSERVE_NATIVE_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
IDENTITY_TIMEOUT_S = 30.0  # `cc --version` and `cc -dumpmachine`


class BuildError(RuntimeError):
    """A compiler is here but gave no library: it failed, could not run, or ran too long."""


class NoCompilerError(RuntimeError):
    """No compiler here, and no library of these sources and flags was built beforehand."""


def default_dir() -> Path:
    """$PDSERVE_HOME/native (PDSERVE_HOME defaults to ~/.cache/pdserve): the build cache."""
    return Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve")) / "native"


def find_compiler() -> list[str] | None:
    """The compiler's command, its program resolved on PATH ($CC split as a shell would, else
    cc, else gcc), or None when there is none."""
    cc = shlex.split(os.environ.get("CC", ""))
    for name in [cc[0]] if cc else ["cc", "gcc"]:
        path = shutil.which(name)
        if path is not None:
            return [path, *cc[1:]]
    return None


def compiler_identity(compiler: list[str]) -> str:
    """What stands for the compiler in the cache key: the first line of its `--version` and its
    `-dumpmachine` target."""
    lines = []
    for flag in ("--version", "-dumpmachine"):
        try:
            done = subprocess.run([*compiler, flag], capture_output=True, text=True,
                                  timeout=IDENTITY_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"cannot run {shlex.join([*compiler, flag])}: {e}") from e
        if done.returncode != 0 or not done.stdout.strip():
            raise BuildError(f"{shlex.join([*compiler, flag])} failed (exit {done.returncode}): "
                             f"{done.stderr.strip()}")
        lines.append(done.stdout.strip().splitlines()[0])
    return "\n".join(lines)


def source_key(isa: str) -> str:
    """16 hex digits over every file of kernels/csrc (names and contents) and `isa`'s flags."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown ISA {isa!r}; the builds are {', '.join(ISA_FLAGS)}")
    digest = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.c"), *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*FLAGS, *ISA_FLAGS[isa], *LIBS]).encode())
    return digest.hexdigest()[:16]


def library_name(isa: str, identity: str) -> str:
    """The file name of `isa`'s build by the compiler of `identity` (compiler_identity)."""
    compiler_key = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return f"{PREFIX}-{isa}-{source_key(isa)}-{compiler_key}.so"


def find_prebuilt(directory: Path, isa: str) -> Path | None:
    """A library of these sources and `isa`'s flags in `directory`, whichever compiler built it
    (the newest when there are several), or None."""
    found = Path(directory).glob(f"{PREFIX}-{isa}-{source_key(isa)}-*.so")
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def build(out_dir: Path | None = None, isa: str = "avx2", timeout: float | None = None) -> Path:
    """The library for `isa` in `out_dir` (default_dir() when None), compiled there first when
    this compiler has not built these sources yet; without a compiler, any prebuilt library of
    these sources there, else NoCompilerError. Building needs no CPU support: an image can
    hold every ISA's build. BuildError when the compiler fails or runs past `timeout` seconds
    (None: $PDSERVE_NATIVE_BUILD_TIMEOUT, else 300)."""
    out_dir = Path(out_dir) if out_dir is not None else default_dir()
    compiler = find_compiler()
    if compiler is None:
        prebuilt = find_prebuilt(out_dir, isa)
        if prebuilt is None:
            wanted = f"CC={os.environ['CC']!r}" if os.environ.get("CC") else "cc or gcc"
            raise NoCompilerError(f"no C compiler ({wanted} not on PATH) and no prebuilt {isa} "
                                  f"library of these sources in {out_dir}")
        return prebuilt
    target = out_dir / library_name(isa, compiler_identity(compiler))
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_suffix(".lock")):
        if not target.exists():  # else built by the process that held the lock before
            _compile(compiler, isa, target, _timeout_s(timeout))
    return target


def _timeout_s(timeout: float | None) -> float:
    if timeout is not None:
        return timeout
    setting = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        return float(setting) if setting else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={setting!r} is not a number of seconds") from None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing), held for the block; the kernel drops
    it when the holder exits, however it exits."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building %s",
                        path.with_suffix(".so").name)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _compile(compiler: list[str], isa: str, target: Path, timeout: float) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    sources = [str(p) for p in sorted(CSRC.glob("*.c"))]
    command = [*compiler, *FLAGS, *ISA_FLAGS[isa], *sources, "-o", tmp, *LIBS]
    what = f"{shlex.join(compiler)} (the {isa} build of {CSRC})"
    try:
        try:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True)
        except OSError as e:
            raise BuildError(f"cannot run {what}: {e}") from e
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the driver and the cc1 / ld it started
            proc.communicate()
            raise BuildError(f"{what} did not finish within {timeout:g} s (the timeout; "
                             f"{TIMEOUT_ENV} sets it)") from None
        if proc.returncode != 0:
            raise BuildError(f"{what} failed (exit {proc.returncode}):\n{stderr.strip()}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users from loading it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s with %s", target, shlex.join(compiler))
