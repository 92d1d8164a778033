"""The ctypes mirrors of the structs the C kernels take, checked against the library's own.

ctypes lays a Structure out from its `_fields_` by the platform's C rules; nothing ties that to
the C declaration in csrc/cpu_kernels.h but this check. The library reports, through
pd_struct_layout (csrc/layout.c), every struct it takes with its sizeof and each field's name,
offsetof and sizeof as its compiler laid them out; `check_structs` compares every one with its
mirror here and raises LayoutError naming the struct, the field and both numbers on the first
disagreement. native.load() runs it on every library it opens, so a stale mirror fails loudly
instead of having a kernel read a pointer out of an int.
"""

from __future__ import annotations

import ctypes

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class Matrix(ctypes.Structure):
    """pd_matrix: a quantized weight as the C kernels read it (kind 4: q4, 8: q8; int8_x: packed
    for pd_i8_matmul, the activations quantized to int8)."""

    _fields_ = [("kind", ctypes.c_int32), ("int8_x", ctypes.c_int32), ("n", _i64), ("k", _i64),
                ("qs", _p), ("d", _p), ("c", _p), ("bias", _p)]


class Layer(ctypes.Structure):
    """pd_layer: one decoder layer's float32 norm weights and quantized projections."""

    _fields_ = [("in_norm", _p), ("post_norm", _p), ("qkv", Matrix), ("o", Matrix),
                ("gate_up", Matrix), ("down", Matrix), ("window", ctypes.c_int64),
                ("q_norm", _p), ("k_norm", _p), ("attn_out_norm", _p), ("mlp_out_norm", _p),
                ("act", ctypes.c_int32), ("local_rope", ctypes.c_int32),
                ("softcap", ctypes.c_float), ("act_alpha", ctypes.c_float),
                ("act_limit", ctypes.c_float), ("sinks", _p), ("moe", _p)]


class Moe(ctypes.Structure):
    """pd_moe: a mixture of experts' MLP (a float32 router and its optional bias, the experts'
    Matrix arrays, an optional shared expert and its float32 gate vector), pointed to by a
    Layer's `moe`."""

    _fields_ = [("router", _p), ("num_experts", ctypes.c_int32), ("top_k", ctypes.c_int32),
                ("norm_topk", ctypes.c_int32), ("reserved", ctypes.c_int32), ("width", _i64),
                ("gate_up", _p), ("down", _p), ("shared_width", _i64),
                ("shared_gate_up", Matrix), ("shared_down", Matrix), ("shared_gate", _p),
                ("router_bias", _p)]


MIRRORS: dict[str, type[ctypes.Structure]] = {"pd_matrix": Matrix, "pd_layer": Layer,
                                              "pd_moe": Moe}

# struct name -> (sizeof, {field: (offsetof, sizeof)} in declaration order)
StructLayouts = dict[str, tuple[int, dict[str, tuple[int, int]]]]


class LayoutError(RuntimeError):
    """A ctypes mirror disagrees with the library's layout of its struct."""


def struct_layouts(lib: ctypes.CDLL) -> StructLayouts:
    """Every struct `lib` takes, as its compiler laid it out (pd_struct_layout)."""
    fn = lib.pd_struct_layout
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                   ctypes.POINTER(_i64), ctypes.POINTER(_i64)]
    fn.restype = ctypes.c_int
    name, offset, size = ctypes.c_char_p(), _i64(), _i64()

    def entry(s: int, i: int) -> tuple[str, int, int] | None:  # i = -1: the struct itself
        if fn(s, i, ctypes.byref(name), ctypes.byref(offset), ctypes.byref(size)) != 0:
            return None
        return name.value.decode(), offset.value, size.value

    layouts: StructLayouts = {}
    s = 0
    while (struct := entry(s, -1)) is not None:
        fields, i = {}, 0
        while (field := entry(s, i)) is not None:
            fields[field[0]] = field[1:]
            i += 1
        layouts[struct[0]] = (struct[2], fields)
        s += 1
    return layouts


def check_struct(lib: ctypes.CDLL, name: str, mirror: type[ctypes.Structure]) -> None:
    """Raises LayoutError unless `mirror` has exactly the fields of `lib`'s struct `name`, each
    at the same offset with the same size, and the same total size."""
    layouts = struct_layouts(lib)
    if name not in layouts:
        raise LayoutError(f"{name}: not a struct the library reports (it has "
                          f"{', '.join(layouts) or 'none'})")
    size, fields = layouts[name]
    where = f"the ctypes mirror {mirror.__name__}"
    names = [f[0] for f in mirror._fields_]
    for field, (offset, field_size) in fields.items():
        if field not in names:
            raise LayoutError(f"{name}.{field}: at offset {offset} ({field_size} bytes) in the "
                              f"library, missing from {where}")
        got = getattr(mirror, field)
        if (got.offset, got.size) != (offset, field_size):
            raise LayoutError(f"{name}.{field}: offset {offset} ({field_size} bytes) in the "
                              f"library, offset {got.offset} ({got.size} bytes) in {where}")
    for field in names:
        if field not in fields:
            raise LayoutError(f"{name}.{field}: in {where}, not a field of the library's struct")
    if ctypes.sizeof(mirror) != size:
        raise LayoutError(f"{name}: {size} bytes in the library, {ctypes.sizeof(mirror)} bytes "
                          f"in {where}")


def check_structs(lib: ctypes.CDLL) -> None:
    """check_struct for every struct `lib` reports; each must have its mirror in MIRRORS."""
    for name in struct_layouts(lib):
        if name not in MIRRORS:
            raise LayoutError(f"{name}: the library takes it and kernels/native_structs.py has "
                              f"no ctypes mirror of it")
        check_struct(lib, name, MIRRORS[name])
