"""OpenMP's and MKL's settings for the engine, set in the environment as engine_core is
imported."""

import os

# OpenMP's idle threads (torch's and the C kernels', one libgomp) spin for GOMP_SPINCOUNT
# iterations after each parallel region before they sleep: 300,000 by default, a few hundred
# microseconds of a core per region gap, taken from the Python between two steps and from the
# stack's other processes. 3,000 still spans the gaps inside one C call; on a shared 2-core
# machine it halved a loaded batch-1 decode step and cut the offline engine's CPU per token
# by a third (docs/benchmarks.md, host cost per token). Set before torch loads libgomp; a
# user's value wins. libgomp reads it once, as it loads: a program that imported torch first
# keeps the default, and its engine says so (platforms/cpu).
SPIN_SET_TOO_LATE = False  # torch loaded libgomp before this module set the count
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "3000"
    try:
        with open("/proc/self/maps") as _maps:
            SPIN_SET_TOO_LATE = "libgomp" in _maps.read()
    except OSError:  # not Linux: nothing to tell
        pass

# MKL's float32 matmuls (torch's on the CPU) pick their kernel and the order of a row's sums
# from the call's shape and the thread count: on an AVX-512 Xeon a row multiplied alone and
# the same row beside one other differed in the last bits. MKL's strict conditional numerical
# reproducibility makes each row's result independent of both, at no measured speed cost
# (docs/architecture/engine.md, same output everywhere). MKL reads it at its first call; a
# user's value wins. A program whose torch multiplied before engine_core was imported keeps
# MKL's default, and its CPU platform says so (platforms/cpu/prefill_matmuls.py).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
