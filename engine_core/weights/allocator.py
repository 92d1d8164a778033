"""Freed heap memory back to the OS while a model loads (glibc's malloc_trim).

Building the decode weights frees buffers of many sizes (each tensor's integers, once fused
into its projection's matrix) and allocates others (the fused matrices). glibc serves buffers
under 32 MiB from its heap once larger ones have come and gone, and memory freed there stays
in the process, in holes the next sizes do not fit: on a GGUF of TinyLlama's widths the load's
peak grew by 0.3 GB (docs/benchmarks.md, GGUF types). malloc_trim hands the free pages back. Elsewhere (another
C library) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no such function)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the OS; whether any were (False without glibc)."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))
