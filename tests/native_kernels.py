"""When the tests may do without the C kernels (kernels/native.py): only where this machine
cannot build or run them, or they were turned off. Where a compiler (or a prebuilt library) and
an AVX2/FMA CPU are there they must load, and a failed build fails the test with the
compiler's message; `native.load()` alone returns None and logs it, so a skip decided on
load() alone would turn a broken build into skipped tests.

    pytestmark = pytest.mark.skipif(why_no_native_kernels() is not None, reason=...)
    lib = require_native_kernels("avx2")  # skips, or fails with the compiler's error
"""

from __future__ import annotations

import ctypes

import pytest

from kernels import native


def why_no_native_kernels() -> str | None:
    """Why the C kernels cannot be used here (a reason to skip), or None when they must work:
    PDSERVE_NATIVE=0, no C compiler and no prebuilt library, or a CPU without AVX2 and FMA."""
    if native.load() is not None or native.build_error() is not None:
        return None  # loaded, or it should have: the tests fail with the error
    try:
        native.require()
    except native.NativeUnavailable as e:
        return str(e)
    return None


def require_native_kernels(isa: str | None = None) -> ctypes.CDLL:
    """`native.load(isa)`; skips where why_no_native_kernels() has a reason, and raises with
    the build error where the kernels should have loaded."""
    reason = why_no_native_kernels()
    if reason is not None:
        pytest.skip(reason)
    return native.require(isa)


def native_sampling():
    """The CPU platform's sampling kernels (engine_core/platforms/cpu.NativeSampling) over the
    C library, or None where it does not load (why_no_native_kernels says why)."""
    from engine_core.platforms.cpu import NativeSampling

    lib = native.load()
    return NativeSampling(lib) if lib is not None else None
