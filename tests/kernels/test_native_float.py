"""The C kernels' float kinds (32: float32, 16: bfloat16): a model's float weights multiplied
as loaded, in place, with float32 activations (NativeFloatMatmul), so a float model's decode
rows take the one-call C layers. Checked against float64 references on every build this CPU
runs, batch and thread invariant, and refused by the int8-activation kernel."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from tests.kernels.test_native import NO_NATIVE_KERNELS, assert_rows_invariant
from tests.native_kernels import require_native_kernels

pytestmark = pytest.mark.skipif(NO_NATIVE_KERNELS is not None, reason=str(NO_NATIVE_KERNELS))


@pytest.fixture(params=native.cpu_isas())
def lib(request):
    return require_native_kernels(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# odd and even column counts (the AVX-512 tile takes columns in pairs), rows past a tile of 8
@pytest.mark.parametrize("m,n,k", [(21, 101, 576), (1, 16, 32), (8, 3, 64), (256, 96, 128)])
def test_float_matmul_matches_float64_reference(lib, dtype, m, n, k):
    from engine_core.platforms.cpu.decode_quant import NativeFloatMatmul

    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(m, k, generator=g)
    layer = NativeFloatMatmul(w, lib)
    assert layer.kind == {torch.float32: 32, torch.bfloat16: 16}[dtype]
    assert layer.qs.data_ptr() == w.data_ptr()  # the weight as loaded, not a copy
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # the weight exactly as stored (bf16 widens exactly); float32 sums of k products
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_float_rows_are_batch_and_thread_invariant(lib, dtype):
    from engine_core.platforms.cpu.decode_quant import NativeFloatMatmul

    w = (torch.randn(201, 576, generator=torch.Generator().manual_seed(5)) * 0.05).to(dtype)
    assert_rows_invariant(NativeFloatMatmul(w, lib), 576)


def test_float_kinds_are_refused_where_they_do_not_apply(lib):
    from engine_core.platforms.cpu.decode_quant import NativeFloatMatmul

    with pytest.raises(ValueError, match="float32 or bfloat16"):
        NativeFloatMatmul(torch.zeros(4, 32, dtype=torch.float16), lib)
    with pytest.raises(ValueError, match="contiguous"):
        NativeFloatMatmul(torch.zeros(32, 4).T, lib)
    if not native.has_int8(lib):
        return
    # int8 activations multiply packed integer tiles: a float weight is not one (-2)
    w, x, y = torch.zeros(16, 32), torch.zeros(1, 32), torch.zeros(1, 16)
    status = lib.pd_i8_matmul(x.data_ptr(), 1, 32, 32, w.data_ptr(), None, None, 16,
                              y.data_ptr(), 1)
    assert status == -2
