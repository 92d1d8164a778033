"""The ctypes mirrors of the C kernels' structs against the library's own layout
(kernels/native_structs.py, pd_struct_layout in kernels/csrc/layout.c)."""

from __future__ import annotations

import ctypes

import pytest

from kernels import native, native_structs


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    if native.load() is None and native.build_error() is None:
        pytest.skip("no C compiler or no AVX2/FMA here")
    return native.require()  # a failed build fails here, with the compiler's error


def test_mirrors_match_the_library(lib):
    native_structs.check_structs(lib)
    layouts = native_structs.struct_layouts(lib)
    assert set(layouts) == set(native_structs.MIRRORS)
    assert layouts["pd_matrix"][0] == ctypes.sizeof(native.Matrix)
    assert layouts["pd_layer"][0] == ctypes.sizeof(native.Layer)
    assert list(layouts["pd_layer"][1]) == [f for f, _ in native.Layer._fields_]


def matrix_mirror(fields: list[str]) -> type[ctypes.Structure]:
    types = dict(native.Matrix._fields_) | {"extra": ctypes.c_int64}
    return type("WrongMatrix", (ctypes.Structure,), {"_fields_": [(f, types[f]) for f in fields]})


FIELDS = [f for f, _ in native.Matrix._fields_]


@pytest.mark.parametrize("fields,message", [
    ([*FIELDS[:2], "k", "n", *FIELDS[4:]],
     r"pd_matrix\.n: offset 8 \(8 bytes\) in the library, offset 16 \(8 bytes\) in the ctypes "
     r"mirror WrongMatrix"),
    (FIELDS[:-1], r"pd_matrix\.bias: at offset 48 \(8 bytes\) in the library, missing from the "
                  r"ctypes mirror WrongMatrix"),
    ([*FIELDS, "extra"], r"pd_matrix\.extra: in the ctypes mirror WrongMatrix, not a field"),
], ids=["reordered", "missing", "extra"])
def test_wrong_mirror_is_refused_naming_the_field(lib, fields, message):
    with pytest.raises(native_structs.LayoutError, match=message):
        native_structs.check_struct(lib, "pd_matrix", matrix_mirror(fields))


def test_struct_without_a_mirror_is_refused(lib, monkeypatch):
    monkeypatch.delitem(native_structs.MIRRORS, "pd_layer")
    with pytest.raises(native_structs.LayoutError, match=r"pd_layer: .* no ctypes mirror"):
        native_structs.check_structs(lib)
