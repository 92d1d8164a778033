"""When the tests may do without the C kernels (kernels/native.py): only where this machine
cannot build or run them, or they were turned off. With a C compiler and an AVX2/FMA CPU they
must build, and a failed build fails the test with the compiler's message; `native.load()`
alone would return None and log it, which used to turn a broken build into skipped tests.

    pytestmark = pytest.mark.skipif(why_no_native_kernels() is not None, reason=...)
    lib = require_native_kernels("avx2")  # skips or builds; fails with the compiler's error
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from kernels import native


def why_no_native_kernels() -> str | None:
    """Why the C kernels cannot be used here (a reason to skip), or None when they must work:
    PDSERVE_NATIVE=0, no C compiler, or a CPU without AVX2 and FMA."""
    if os.environ.get(native.ENV, "1").strip() == "0":
        return f"{native.ENV}=0 turns the native kernels off"
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        return "no C compiler (cc or gcc) on PATH"
    if not native.cpu_isas():
        return "this CPU has no AVX2/FMA"
    return None


def require_native_kernels(isa: str | None = None) -> ctypes.CDLL:
    """The library `native.load(isa)` gives, after building `isa` (or every build this CPU runs)
    here so that a compiler error raises with its message; skips where why_no_native_kernels()
    has a reason."""
    reason = why_no_native_kernels()
    if reason is not None:
        pytest.skip(reason)
    for each in [isa] if isa else native.cpu_isas():
        native.build(isa=each)  # RuntimeError with the compiler's output when it fails
    lib = native.load(isa)
    assert lib is not None, f"native.load({isa!r}) is None although the build succeeded (see log)"
    return lib
