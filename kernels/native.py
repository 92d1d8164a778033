"""The C kernels of kernels/csrc, built by kernels/native_build.py and called through ctypes.

    kernels/csrc/*.c --cc -O3 -mavx2 -mfma [-mavx512f ...] -fopenmp-->
        cpu_decode-<isa>-<source key>-<compiler key>.so

(csrc/cpu_kernels.h lists the files.) Three builds of one source: "avx2" (AVX2 + FMA),
"avx512" (adds AVX-512 F/BW/VL/DQ, whose matmul tiles use 16-float vectors and 16-row tiles)
and "avx512vnni" (adds VNNI and with it pd_i8_matmul, int8 activations); `load()` takes the
widest this CPU runs. PDSERVE_NATIVE=0 turns them off; PDSERVE_NATIVE=avx2 (or avx512) keeps
a narrower build.

Where `load()` finds the library, first that exists:
1. $PDSERVE_NATIVE_DIR, a directory of prebuilt libraries: a build of these sources and flags
   there is used whichever compiler made it, and no compiler is needed;
2. $PDSERVE_HOME/native (default ~/.cache/pdserve/native), the build cache: with a compiler,
   the build of this compiler's version (compiled there on first use, once, under a file lock,
   while processes starting together wait for it); without one, any build of these sources.
`python -m kernels.native [DIR]` builds every ISA into DIR (default $PDSERVE_NATIVE_DIR, else
the cache), for an image; the Dockerfile does.

`load()` returns None (logged once; callers use their torch path) when there is no way: a CPU
without AVX2 and FMA, or no compiler and no prebuilt library. A build that failed (compiler
errors, timeout) also returns None but is an error: `build_error()` returns its message and
`require()` raises it. A library whose structs disagree with the ctypes mirrors
(native_structs.py) is never used: `load()` raises LayoutError.

OpenMP: the library links the same libgomp.so.1 that torch has already loaded, so both share
one thread pool; callers pass torch.get_num_threads().
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kernels import huge_pages
from kernels.native_build import (
    ISA_FLAGS,
    BuildError,
    NoCompilerError,
    build,
    default_dir,
    find_prebuilt,
)
from kernels.native_structs import Layer as Layer  # re-exported: callers build the structs
from kernels.native_structs import LayoutError as LayoutError
from kernels.native_structs import Matrix as Matrix
from kernels.native_structs import Moe as Moe
from kernels.native_structs import check_structs

logger = logging.getLogger(__name__)
ENV = "PDSERVE_NATIVE"
DIR_ENV = "PDSERVE_NATIVE_DIR"
I8_COLS = 16  # output columns per tile of pd_i8_matmul's packed weights

_p, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # name: (argument types, result type)
    "pd_q4_matmul": ([_p, _i64, _i64, _p, _p, _p, _i64, _p, _int], _int),
    "pd_q8_matmul": ([_p, _i64, _i64, _int, _p, _p, _p, _i64, _p, _int], _int),
    "pd_row_attention": ([_p, _i64, _int, _int, _int, _p, _p, _int, _p, _p, _i64, _p, _p,
                          _int, _f32, _p, _i64, _int, _i64, _f32, _p], _int),
    "pd_row_attention_bf16": ([_p, _p, _i64, _int, _int, _int, _p, _p, _int, _p, _p, _i64,
                               _p, _p, _int, _f32, _p, _i64, _int, _i64, _f32, _p], _int),
    "pd_add_rms_norm": ([_p, _p, _p, _f32, _p, _i64, _i64], None),
    "pd_add_rms_norm_bf16": ([_p, _p, _p, _f32, _p, _i64, _i64, _int], None),
    "pd_topk": ([_p, _i64, _i64, _int, _p, _int], None),
    "pd_sample": ([_p, _i64, _i64, _p, _p, _p, _p, _p, _p, _p, _int], None),
    "pd_decode_layers": ([_p, _i64, _i64, _p, _int, _i64, _f32, _int, _int, _int, _p, _p, _p,
                          _i64,
                          _int, _p, _p, _i64, _p, _int, _f32, _i64, _p, _p, _int], _int),
    "pd_moe_experts": ([_p, _i64, _i64, _p, _p, _int, _i64, _int, _f32, _f32, _p, _p, _p, _p,
                        _int], _int),
}
VNNI_SIGNATURES = {"pd_i8_matmul": ([_p, _i64, _i64, _int, _p, _p, _p, _i64, _p, _int], _int)}


class NativeUnavailable(RuntimeError):
    """require() has no library to give: why, or the failed build's error."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isas() -> list[str]:
    """The builds this CPU runs, narrowest first (torch's AVX512 level has F, BW, VL and DQ;
    VNNI is read from /proc/cpuinfo)."""
    level = torch.backends.cpu.get_cpu_capability()
    isas = {"AVX2": ["avx2"], "AVX512": ["avx2", "avx512"]}.get(level, [])
    if "avx512" in isas and "avx512_vnni" in _cpu_flags():
        isas.append("avx512vnni")
    return isas


def has_int8(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` is a build with the int8-activation matmul (VNNI)."""
    return lib is not None and hasattr(lib, "pd_i8_matmul")


def library_path(isa: str) -> Path:
    """The library load() opens for `isa`: a prebuilt one in $PDSERVE_NATIVE_DIR, else
    build() in $PDSERVE_HOME/native."""
    prebuilt_dir = os.environ.get(DIR_ENV)
    if prebuilt_dir:
        found = find_prebuilt(Path(prebuilt_dir), isa)
        if found is not None:
            return found
    try:
        return build(isa=isa)
    except NoCompilerError as e:
        if prebuilt_dir:
            raise NoCompilerError(f"{e}, nor in {DIR_ENV}={prebuilt_dir}") from None
        raise


@dataclass(frozen=True)
class _Loaded:
    lib: ctypes.CDLL | None
    reason: str | None = None  # why lib is None
    error: str | None = None  # the failed build's (or load's) error; None when there was no way


@cache
def _load(isa: str | None) -> _Loaded:
    setting = os.environ.get(ENV, "1").strip().lower()
    if setting == "0":
        return _Loaded(None, f"turned off by {ENV}=0")
    isas = cpu_isas()
    if not isas:
        logger.info("native CPU kernels need AVX2 and FMA; using the torch path")
        return _Loaded(None, "this CPU has no AVX2 and FMA")
    isa = isa or (setting if setting in ISA_FLAGS else isas[-1])
    if isa not in isas:
        logger.info("this CPU cannot run the %s build of the native kernels; using %s",
                    isa, isas[-1])
        isa = isas[-1]
    try:
        lib = ctypes.CDLL(str(library_path(isa)))
    except NoCompilerError as e:
        logger.warning("native CPU kernels unavailable, using the torch path: %s", e)
        return _Loaded(None, str(e))
    except (OSError, BuildError) as e:
        logger.warning("native CPU kernels failed to build or load, using the torch path: %s", e)
        return _Loaded(None, str(e), str(e))
    check_structs(lib)  # LayoutError: never call into a library the mirrors disagree with
    for name, (args, result) in (SIGNATURES | (VNNI_SIGNATURES if isa == "avx512vnni"
                                                 else {})).items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return _Loaded(lib)


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled library (the widest build this CPU runs, or `isa`), or None (logged once)
    when it cannot be used here; see build_error() for whether that is a failure."""
    return _load(isa).lib


def build_error(isa: str | None = None) -> str | None:
    """Why load(isa) failed when a compiler was there (its error output, the timeout) or the
    library would not open; None when it loaded or there was no way (no AVX2/FMA, no compiler
    and no prebuilt library, PDSERVE_NATIVE=0)."""
    return _load(isa).error


def require(isa: str | None = None) -> ctypes.CDLL:
    """load(isa), raising NativeUnavailable with the reason or the build error for None."""
    loaded = _load(isa)
    if loaded.lib is None:
        raise NativeUnavailable(f"native CPU kernels unavailable: {loaded.reason}")
    return loaded.lib


def _pad_columns(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [ceil(N / 16) * 16, ...]
    pad = -t.shape[0] % I8_COLS
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t


def _tiles(t: torch.Tensor) -> torch.Tensor:  # [N, K / 32] -> [N / 16, K / 32, 16] float32
    t = _pad_columns(t.float())
    return t.view(-1, I8_COLS, t.shape[1]).permute(0, 2, 1).contiguous()


def pack_q4_int8(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor):
    """q [N, K] 0..15, d and c [N, K / 32] as pd_i8_matmul's q4 tiles (csrc/matmul_int8.c):
    byte (tile, group, j, n, i) holds k = 8j + i in its low nibble and 8j + 4 + i in its high."""
    n, k = q.shape
    q = _pad_columns(q.to(torch.uint8)).view(-1, I8_COLS, k // 32, 4, 2, 4)  # t n g j h i
    q = q.permute(0, 2, 3, 1, 5, 4)  # t g j n i h
    return (huge_pages.copy(q[..., 0] | (q[..., 1] << 4)), huge_pages.copy(_tiles(d)),
            huge_pages.copy(_tiles(c)))


def pack_q8_int8(q: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None):
    """q [N, K] int8, d (and c) [N, K / 32] as pd_i8_matmul's q8 tiles: byte (tile, group, m,
    n, i) is q[n, 32 g + 4 m + i] + 128; d [N / 16, K / 32, 16]. A half kind's d (and c),
    [N, K / 16], become [N / 16, K / 32, 2, 16]. Returns (q, d, c or None)."""
    n, k = q.shape
    packed = (_pad_columns(q).to(torch.int16) + 128).to(torch.uint8)
    packed = packed.view(-1, I8_COLS, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # t g m n i

    def scales(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == k // 32:
            return _tiles(t)
        t = _pad_columns(t.float()).view(-1, I8_COLS, k // 32, 2)  # t n g h
        return t.permute(0, 2, 3, 1).contiguous()  # t g h n

    return (huge_pages.copy(packed), huge_pages.copy(scales(d)),
            None if c is None else huge_pages.copy(scales(c)))


def check(status: int) -> None:
    """A kernel's status: 0, -1 when it could not allocate its scratch, -2 for a weight kind
    it does not know."""
    if status == -2:
        raise ValueError("native CPU kernel was given a weight kind it does not know")
    if status != 0:
        raise MemoryError("native CPU kernel could not allocate its scratch memory")


def row_attention(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,  # [S, (Hq + 2 Hkv) * D] float32 (q and k rotated in place) or bfloat16
    # (left as it is), contiguous
    cos_sin: torch.Tensor,  # [S, D] float32: cos | sin of each row's position
    kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D] float32 or bf16, contiguous
    slot_mapping: torch.Tensor,  # [S] int64
    block_tables: torch.Tensor,  # [S, max_blocks] int32, or [T, max_blocks] with table_of_row
    context_lens: torch.Tensor,  # [S] int32
    num_heads: int,
    scale: float,
    max_len: int,  # context_lens.max() (0: computed here)
    table_of_row: torch.Tensor | None = None,  # [S] int32: each row's block table
    window: int | None = None,  # a sliding window: each row's last `window` positions
    softcap: float | None = None,  # scores capped to softcap * tanh(s / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [Hq] float32 contiguous: attention sinks (GPT-OSS)
) -> torch.Tensor:  # [S, Hq * D] in qkv's dtype
    """Rotary embedding, K/V store and attention of S query rows in one call, each over its
    own context (see pd_row_attention in csrc/attention.c): decode rows, a token and its
    drafts, or the rows of prefill chunks (several rows sharing a sequence's table). The
    kernel computes in float32; bfloat16 rows are converted on the way in and out, as
    torch's .float() and .to(torch.bfloat16) around the call would be, bit for bit."""
    if window is not None and window < 1:
        raise ValueError(f"row_attention: window must be >= 1 or None, got {window}")
    num_rows = qkv.shape[0]
    num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
    is_bf16 = qkv.dtype == torch.bfloat16
    layouts = ((qkv, torch.bfloat16 if is_bf16 else torch.float32), (cos_sin, torch.float32),
               (slot_mapping, torch.int64), (context_lens, torch.int32))
    if (any(t.dtype != dtype or not t.is_contiguous() for t, dtype in layouts)
            or kv_layer.dtype not in (torch.float32, torch.bfloat16) or not kv_layer.is_contiguous()
            or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1
            or (table_of_row is not None and (table_of_row.dtype != torch.int32
                                              or not table_of_row.is_contiguous()))
            or head_dim % 8 or head_dim > 256 or num_heads % num_kv_heads
            or (sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                                       or tuple(sinks.shape) != (num_heads,)))):
        raise ValueError("row_attention: float32 or bfloat16 rows, float32/int64/int32 "
                         "contiguous inputs, a float32 or bfloat16 cache, head_dim a multiple "
                         "of 8 up to 256, query heads a multiple of KV heads, sinks float32 "
                         "[num_heads]")
    if max_len <= 0:  # the caller did not know it
        max_len = int(context_lens.max())
    out = torch.empty((num_rows, num_heads * head_dim), dtype=qkv.dtype)
    work = torch.empty(qkv.shape, dtype=torch.float32) if is_bf16 else None  # rotated rows
    rows = (qkv.data_ptr(), work.data_ptr()) if is_bf16 else (qkv.data_ptr(),)
    check((lib.pd_row_attention_bf16 if is_bf16 else lib.pd_row_attention)(
        *rows, num_rows, num_heads, num_kv_heads, head_dim, cos_sin.data_ptr(),
        kv_layer.data_ptr(), kv_layer.dtype == torch.bfloat16, slot_mapping.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0),
        None if table_of_row is None else table_of_row.data_ptr(), context_lens.data_ptr(),
        kv_layer.shape[2], scale,
        out.data_ptr(), max_len, torch.get_num_threads(), window or 0, softcap or 0.0,
        None if sinks is None else sinks.data_ptr()))
    return out


def decode_layers(
    lib: ctypes.CDLL,
    layers,  # ctypes array of Layer, at least num_layers long
    num_layers: int,
    h: torch.Tensor,  # [S, H] float32 contiguous: the embeddings; the residual stream after
    cos_sin: torch.Tensor,  # [S, D] float32
    kv_cache: torch.Tensor,  # [num_layers, num_blocks, 2, block_size, Hkv, D] contiguous
    slot_mapping: torch.Tensor,  # [S] int64
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    num_heads: int,
    intermediate: int,
    eps: float,
    scale: float,
    max_len: int,
    final_norm: torch.Tensor,  # [H] float32
    cos_sin_local: torch.Tensor | None = None,  # [S, D] float32: the local_rope layers'
) -> torch.Tensor:  # [S, H] float32: rmsnorm(h) * final_norm
    """S decode rows through num_layers decoder layers in one call (pd_decode_layers)."""
    if cos_sin_local is None:
        cos_sin_local = cos_sin
    num_kv_heads, head_dim = kv_cache.shape[4], kv_cache.shape[5]
    out = torch.empty_like(h)
    check(lib.pd_decode_layers(
        h.data_ptr(), h.shape[0], h.shape[1], ctypes.addressof(layers), num_layers,
        intermediate, eps, num_heads, num_kv_heads, head_dim, cos_sin.data_ptr(),
        cos_sin_local.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.dtype == torch.bfloat16,
        slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        context_lens.data_ptr(), kv_cache.shape[3], scale, max_len, final_norm.data_ptr(),
        out.data_ptr(), torch.get_num_threads()))
    return out


def moe_experts(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [S, H] float32 contiguous
    gate_up,  # ctypes array of Matrix, one per expert: [2 * intermediate, H]
    down,  # ctypes array of Matrix, one per expert: [H, intermediate]
    intermediate: int,
    act: tuple[int, float, float],  # the activation (ACT_*), its alpha and limit: Activation
    counts: torch.Tensor,  # [experts] int64: pairs per expert
    rows: torch.Tensor,  # [pairs] int64: each pair's row, grouped by expert
    weights: torch.Tensor,  # [pairs] float32: each pair's routing weight
    out: torch.Tensor,  # [S, H] float32 contiguous: the experts' weighted outputs added in
) -> torch.Tensor:
    """The routed experts on decode rows in one call (pd_moe_experts)."""
    check(lib.pd_moe_experts(
        x.data_ptr(), x.shape[0], x.shape[1], ctypes.addressof(gate_up), ctypes.addressof(down),
        len(gate_up), intermediate, *act, counts.data_ptr(), rows.data_ptr(),
        weights.data_ptr(), out.data_ptr(), torch.get_num_threads()))
    return out


TOPK_MAX = 64  # pd_topk's largest k


def topk(lib: ctypes.CDLL, x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [rows, k] of each row's k largest values, largest first (equal values: lower
    index first); x float32 contiguous [rows, n], k <= 64 <= n (pd_topk)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or not 0 < k <= min(TOPK_MAX, x.shape[1]):
        raise ValueError(f"topk: a contiguous float32 [rows, n] tensor and 0 < k <= "
                         f"min({TOPK_MAX}, n), got {x.dtype} {tuple(x.shape)} and k={k}")
    idx = torch.empty((x.shape[0], k), dtype=torch.int64)
    lib.pd_topk(x.data_ptr(), x.shape[0], x.shape[1], k, idx.data_ptr(), torch.get_num_threads())
    return idx


def sample(lib: ctypes.CDLL, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor,
           num_kept: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits x [rows, V] (pd_sample; x is overwritten with the weights
    exp((x - max) / T)). Per row: temperature float32 (<= 0: the argmax), top_k int64 (0 or
    >= V: off), top_p float32 in (0, 1], min_p float32 in [0, 1], uniform float64 in [0, 1).
    num_kept, int64 [rows] when given, receives how many tokens each row could have drawn."""
    rows = x.shape[0] if x.dim() == 2 else -1
    per_row = ((temperature, torch.float32), (top_k, torch.int64), (top_p, torch.float32),
               (min_p, torch.float32), (uniform, torch.float64))
    if num_kept is not None:
        per_row += ((num_kept, torch.int64),)
    if (x.dtype != torch.float32 or not x.is_contiguous() or rows < 0 or x.device.type != "cpu"
            or not 0 < x.shape[1] < 2**31
            or any(t.dtype != dt or not t.is_contiguous() or tuple(t.shape) != (rows,)
                   for t, dt in per_row)):
        raise ValueError(f"sample: a contiguous float32 CPU [rows, V] tensor (0 < V < 2**31) and "
                         f"contiguous [rows] parameters, got {x.dtype} {tuple(x.shape)} and "
                         f"{[(t.dtype, tuple(t.shape)) for t, _ in per_row]}")
    out = torch.empty(rows, dtype=torch.int64)
    lib.pd_sample(x.data_ptr(), rows, x.shape[1], temperature.data_ptr(), top_k.data_ptr(),
                  top_p.data_ptr(), min_p.data_ptr(), uniform.data_ptr(), out.data_ptr(),
                  None if num_kept is None else num_kept.data_ptr(), torch.get_num_threads())
    return out


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None,
                 weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual in place (when given), then rmsnorm(x) * weight; [rows, dim], float32,
    or bfloat16 with the bf16 reference's roundings (the sum, the normed row, the product)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if (x.dtype not in (torch.float32, torch.bfloat16)
            or any(t.dtype != x.dtype or not t.is_contiguous() for t in tensors)):
        raise ValueError("add_rms_norm: contiguous tensors, all float32 or all bfloat16")
    y = torch.empty_like(x)
    args = (x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            eps, y.data_ptr(), x.shape[0], x.shape[1])
    if x.dtype == torch.bfloat16:
        lib.pd_add_rms_norm_bf16(*args, torch.get_num_threads())
    else:
        lib.pd_add_rms_norm(*args)
    return y


if __name__ == "__main__":  # python -m kernels.native [DIR]: every ISA's build, for an image
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get(DIR_ENV) or default_dir())
    for name in ISA_FLAGS:
        print(build(out_dir, isa=name))
