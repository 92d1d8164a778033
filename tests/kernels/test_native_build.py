"""How the C kernels' library is built and found (kernels/native_build.py, native.load()),
with the real compiler and real processes.

Stand-in compilers are shell scripts that run the real one: they count compiles in a log,
report another version, fail, or sleep. Fresh builds compile the avx2 ISA only (~5 s each on
2 cores); the module's one real build is copied where a test needs a library already there.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels import native, native_build

REPO = Path(__file__).resolve().parents[2]
REAL_CC = native_build.find_compiler()
pytestmark = pytest.mark.skipif(REAL_CC is None, reason="no C compiler here")
needs_avx2 = pytest.mark.skipif("avx2" not in native.cpu_isas(), reason="no AVX2/FMA here")

LOAD_AVX2 = """
import json
from kernels import native
lib = native.load("avx2")
try:
    native.require("avx2")
    reason = None
except native.NativeUnavailable as e:
    reason = str(e)
print(json.dumps({"path": lib and lib._name, "error": native.build_error("avx2"),
                  "reason": reason}))
"""


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory) -> Path:
    """The avx2 library, built once by the real compiler into a directory of its own."""
    return native_build.build(tmp_path_factory.mktemp("prebuilt"), "avx2")


def stand_in_cc(directory: Path, compile_step: str, version: str | None = None) -> Path:
    """A compiler script: `--version` says `version` (None: the real compiler's), the compile
    runs `compile_step` (shell; $LOG is a file beside the script) and then the real one."""
    script = directory / "cc.sh"
    real = " ".join(REAL_CC)
    version_step = f'echo "{version}"; exit 0' if version else f'exec {real} "$@"'
    script.write_text(f"""#!/bin/sh
LOG="{directory}/compiles.log"
case "$1" in
    --version) {version_step} ;;
    -dumpmachine) exec {real} "$@" ;;
esac
{compile_step}
exec {real} "$@"
""")
    script.chmod(0o755)
    return script


def num_compiles(cc: Path) -> int:
    log = cc.parent / "compiles.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def python_env(tmp_path: Path, home: Path, cc: Path | None = None, **env: str) -> dict[str, str]:
    """The environment of a fresh python loading the kernels: PDSERVE_HOME=home, CC=cc, and
    with no cc: a PATH with no compiler on it."""
    out = {k: v for k, v in os.environ.items()
           if k not in ("CC", "PDSERVE_NATIVE", native.DIR_ENV, native_build.TIMEOUT_ENV)}
    out |= {"PDSERVE_HOME": str(home), "PYTHONPATH": str(REPO), **env}
    if cc is None:
        empty = tmp_path / "empty-bin"
        empty.mkdir(exist_ok=True)
        out["PATH"] = str(empty)
    else:
        out["CC"] = str(cc)
    return out


def load_avx2(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", LOAD_AVX2], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@needs_avx2
@pytest.mark.parametrize("where", ["home", "native_dir"])
def test_prebuilt_library_loads_without_a_compiler(avx2_build, tmp_path, where):
    if where == "home":  # the build cache, as an image's build stage left it
        (tmp_path / "home" / "native").mkdir(parents=True)
        shutil.copy(avx2_build, tmp_path / "home" / "native")
        env = python_env(tmp_path, tmp_path / "home")
    else:
        env = python_env(tmp_path, tmp_path / "home", PDSERVE_NATIVE_DIR=str(avx2_build.parent))
    got = load_avx2(env)
    assert got == {"path": got["path"], "error": None, "reason": None}
    assert Path(got["path"]).name == avx2_build.name


@needs_avx2
def test_no_compiler_and_no_library_is_no_way_not_an_error(tmp_path):
    got = load_avx2(python_env(tmp_path, tmp_path / "home"))
    assert got["path"] is None and got["error"] is None
    assert "no C compiler" in got["reason"] and "no prebuilt avx2 library" in got["reason"]


@needs_avx2
def test_failed_build_is_an_error_load_error_and_require_expose(tmp_path):
    cc = stand_in_cc(tmp_path, 'echo "csrc/matmul.c:1: error: stand-in failure" >&2; exit 1')
    got = load_avx2(python_env(tmp_path, tmp_path / "home", cc))
    assert got["path"] is None
    assert str(cc) in got["error"] and "stand-in failure" in got["error"]
    assert "stand-in failure" in got["reason"]


@needs_avx2
def test_processes_starting_together_compile_once(tmp_path):
    cc = stand_in_cc(tmp_path, 'echo compile >> "$LOG"')
    env = python_env(tmp_path, tmp_path / "home", cc)
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_AVX2], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    paths = {json.loads(out.splitlines()[-1])["path"] for out, _ in outputs}
    assert num_compiles(cc) == 1
    (path,) = paths
    native_dir = tmp_path / "home" / "native"
    assert Path(path).parent == native_dir
    assert sorted(p.name for p in native_dir.iterdir()) == sorted(  # no temporary left behind
        [Path(path).name, Path(path).with_suffix(".lock").name])


def test_compiler_version_is_in_the_cache_key(avx2_build, tmp_path, monkeypatch):
    cc = stand_in_cc(tmp_path, 'echo compile >> "$LOG"', version="stand-in cc 99.1")
    monkeypatch.setenv("CC", str(cc))
    other = native_build.library_name("avx2", native_build.compiler_identity([str(cc)]))
    assert other != avx2_build.name
    assert other.rsplit("-", 1)[0] == avx2_build.name.rsplit("-", 1)[0]  # same sources, flags
    shutil.copy(avx2_build, tmp_path)
    assert native_build.build(tmp_path, "avx2") == tmp_path / other  # built anew
    assert native_build.build(tmp_path, "avx2") == tmp_path / other
    assert num_compiles(cc) == 1
    monkeypatch.setenv("CC", shlex.join(REAL_CC))
    assert native_build.build(tmp_path, "avx2") == tmp_path / avx2_build.name


@pytest.mark.parametrize("through", ["argument", "env"])
def test_compile_past_the_timeout_fails_clearly(tmp_path, monkeypatch, through):
    cc = stand_in_cc(tmp_path, "sleep 60")
    monkeypatch.setenv("CC", str(cc))
    out_dir = tmp_path / "native"
    if through == "env":
        monkeypatch.setenv(native_build.TIMEOUT_ENV, "1")
    start = time.monotonic()
    with pytest.raises(native_build.BuildError, match=r"did not finish within 1 s") as e:
        native_build.build(out_dir, "avx2", timeout=1 if through == "argument" else None)
    assert time.monotonic() - start < 30  # the sleeping compiler was killed, not waited for
    assert str(cc) in str(e.value) and native_build.TIMEOUT_ENV in str(e.value)
    assert [p.suffix for p in out_dir.iterdir()] == [".lock"]  # the temporary is gone


def test_build_is_cached_by_source_version_and_builds_any_isa(avx2_build, tmp_path):
    shutil.copy(avx2_build, tmp_path)
    assert native_build.build(tmp_path, "avx2") == tmp_path / avx2_build.name
    wide = native_build.build(tmp_path, isa="avx512")  # builds without the CPU having AVX-512
    assert wide.name.startswith("cpu_decode-avx512-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [avx2_build.name, wide.name, wide.with_suffix(".lock").name])
