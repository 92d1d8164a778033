"""The C kernels' kind 9 (KIND_NL): 4-bit indices into a 16-entry int8 table times d per 32,
the form IQ4_NL, IQ4_XS and MXFP4 keep (engine_core/weights/gguf_q8.py's NLWeight), against
float64 references, with float32 and int8 activations, batch and thread invariant."""

from __future__ import annotations

import pytest
import torch

from engine_core.weights.gguf_q8 import NL_TABLES, NLWeight
from kernels import native
from tests.kernels.test_native import (
    NO_NATIVE_KERNELS,
    assert_rows_invariant,
    int8_reference_half,
)
from tests.native_kernels import require_native_kernels

pytestmark = pytest.mark.skipif(NO_NATIVE_KERNELS is not None, reason=str(NO_NATIVE_KERNELS))
TABLES = {qtype.name: torch.tensor(table, dtype=torch.int8)
          for qtype, table in NL_TABLES.items() if qtype.name != "IQ4_XS"}  # IQ4_NL's table


@pytest.fixture(params=native.cpu_isas())
def lib(request):
    return require_native_kernels(request.param)


def random_nl(n: int, k: int, table: torch.Tensor, seed: int) -> NLWeight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    d[0, 0] = 0.0  # a zero scale
    return NLWeight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d, table)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("n,k", [(100, 576), (17, 64)])
def test_nl_matmul_matches_float64_reference(lib, table, n, k):
    """Float32 activations: each weight expands to table[q] * d exactly (an integer times d),
    the sums agree with float64 to float32 rounding; int8 activations (the VNNI build): the
    integer dots of pd_i8_matmul's arithmetic, as for the q8 family."""
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul

    w = random_nl(n, k, TABLES[table], seed=n)
    assert torch.equal(w.dequantize(), w.to_q8().dequantize())
    layer = NativeQ8Matmul(w, lib)
    assert layer.kind == 9
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(layer(x).double(), x.double() @ w.dequantize().double().T,
                               atol=1e-5, rtol=1e-5)
    if not native.has_int8(lib):
        return
    x[3] = 0.0
    y = NativeQ8Matmul(w, lib, int8=True)(x).double()
    expected = int8_reference_half(x, w.to_q8())
    scale = expected.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    assert ((y - expected).abs() / scale).max().item() < 1e-5


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_nl_rows_are_batch_and_thread_invariant(lib, int8):
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul

    if int8 and not native.has_int8(lib):
        pytest.skip("int8 activations are in the VNNI build only")
    assert_rows_invariant(NativeQ8Matmul(random_nl(200, 576, TABLES["MXFP4"], seed=7), lib,
                                         int8), 576)
