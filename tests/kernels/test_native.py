"""The C kernels (kernels/csrc/) against torch references, on fresh random inputs: the
matmuls (q4, the q8 family; float32 and int8 activations) and their packings, top-k and
add_rms_norm. The row attention's tests are in test_native_attention.py.

Each is also checked for batch invariance: a row's result is bit for bit the same alone,
batched, permuted and on 1 or 2 threads. Every test runs on each build this CPU can run (avx2,
avx512 where it has AVX-512, avx512vnni where it has VNNI too); the int8-activation matmul is in
the last only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_core.weights.gguf_q4 import Q4Weight
from kernels import native
from tests.helpers import torch_threads
from tests.native_kernels import require_native_kernels, why_no_native_kernels

# skipped only where the kernels cannot build or run; elsewhere a failed build fails each test
NO_NATIVE_KERNELS = why_no_native_kernels()
pytestmark = pytest.mark.skipif(NO_NATIVE_KERNELS is not None, reason=str(NO_NATIVE_KERNELS))


@pytest.fixture(params=native.cpu_isas())
def lib(request):
    return require_native_kernels(request.param)


@pytest.fixture
def vnni_lib():
    if "avx512vnni" not in native.cpu_isas():
        pytest.skip("this CPU has no AVX-512 VNNI")
    return require_native_kernels("avx512vnni")


def random_q4(n: int, k: int, offset: float, seed: int) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    return Q4Weight(
        q=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        d=torch.rand(n, k // 32, generator=g) * 0.02,
        m=torch.zeros(n, k // 32) if offset else torch.randn(n, k // 32, generator=g) * 0.1,
        offset=torch.full((n,), offset),
    )


@pytest.mark.parametrize("offset", [8.0, 0.0], ids=["q4_0", "q4_1"])
@pytest.mark.parametrize("n,k", [(576, 576), (960, 576), (100, 1536)])
def test_q4_matmul_matches_dequantized_weights(lib, n, k, offset):
    from engine_core.platforms.cpu.decode_quant import NativeQ4Matmul

    w = random_q4(n, k, offset, seed=n + k)
    layer = NativeQ4Matmul(w, lib)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(1))
    expected = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-5, rtol=1e-5)


def test_q4_nibbles_round_trip_in_file_order():
    w = random_q4(4, 64, 0.0, seed=3)
    packed = w.packed_nibbles()  # [4, 2, 16]
    assert torch.equal(packed[..., :] & 0xF, w.q.view(4, 2, 32)[..., :16])
    assert torch.equal(packed >> 4, w.q.view(4, 2, 32)[..., 16:])


def test_q8_matmul_requantizes_q8_0_exactly(lib):
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul

    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (300, 576), generator=g).float()
    q[:, ::32] = 127  # every block reaches |q| = 127, as Q8_0 quantization guarantees
    d = (torch.rand(300, 18, generator=g) * 0.01).half().float()
    dense = (q.view(300, 18, 32) * d[..., None]).view(300, 576)
    layer = NativeQ8Matmul(dense, lib)
    assert torch.equal(layer.qs.float(), q) and torch.equal(layer.d, d)
    x = torch.randn(5, 576, generator=g)
    torch.testing.assert_close(layer(x).double(), x.double() @ dense.double().T,
                               atol=1e-5, rtol=1e-5)


def int8_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                   c: torch.Tensor | None) -> torch.Tensor:
    """pd_i8_matmul's arithmetic in float64: x quantized per 32 along K (sx = amax / 127,
    xq = round-half-even(x * (127 / amax)) in float32), integer dots per group, then
    sum_g d * sx * dot (+ c * sum(x) of the group)."""
    m, k = x.shape
    xg = x.view(m, k // 32, 32)
    amax = xg.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # float32, as in C
    xq = torch.round(xg * inv[..., None]).clamp(-128, 127)
    dots = torch.einsum("mgk,ngk->mng", xq.double(), q.double().view(q.shape[0], -1, 32))
    y = (dots * (d.double()[None] * (amax / 127).double()[:, None])).sum(dim=2)
    if c is not None:
        y = y + (c.double()[None] * xg.sum(dim=2).double()[:, None]).sum(dim=2)
    return y


@pytest.mark.parametrize("offset", [8.0, 0.0], ids=["q4_0", "q4_1"])
@pytest.mark.parametrize("n,k", [(576, 576), (100, 1536), (16, 32)])
def test_int8_q4_matmul_matches_its_reference(vnni_lib, n, k, offset):
    from engine_core.platforms.cpu.decode_quant import NativeQ4Matmul

    w = random_q4(n, k, offset, seed=n + k)
    layer = NativeQ4Matmul(w, vnni_lib, int8=True)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(4))
    x[3] = 0.0  # a zero row: scale 0, no NaN
    x[5, :32] *= 1000  # one group far larger than the rest of its row
    y = layer(x).double()
    c = w.m - w.offset[:, None] * w.d
    expected = int8_reference(x, w.q, w.d, c)
    # float32 sums: within 1e-5 of each row's largest output (row 5 sums terms 1000x apart)
    scale = expected.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    assert ((y - expected).abs() / scale).max().item() < 1e-5
    # what the quantization costs against the exact product: about half a percent
    exact = x.double() @ w.dequantize().double().T
    assert ((y - exact).norm() / exact.norm()).item() < 2e-2
    assert torch.equal(y[3], torch.zeros(n, dtype=torch.float64))


@pytest.mark.parametrize("n,k", [(300, 576), (49, 64)])
def test_int8_q8_matmul_matches_its_reference(vnni_lib, n, k):
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul

    g = torch.Generator().manual_seed(n)
    q = torch.randint(-127, 128, (n, k), generator=g).float()
    q[:, ::32] = 127
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    dense = (q.view(n, -1, 32) * d[..., None]).view(n, k)
    layer = NativeQ8Matmul(dense, vnni_lib, int8=True)
    x = torch.randn(9, k, generator=g)
    y = layer(x).double()
    torch.testing.assert_close(y, int8_reference(x, q, d, None), atol=1e-5, rtol=1e-5)
    exact = x.double() @ dense.double().T
    assert ((y - exact).norm() / exact.norm()).item() < 2e-2


def random_q8_family(n: int, k: int, kind: int, seed: int):
    """A random weight of the q8 family (kernels/csrc/cpu_kernels.h): 5 has c, 6 and 7 have d
    (and c) per 16, as Q5_K / Q6_K / a fused mix hold them."""
    from engine_core.weights.gguf_q8 import Q8Weight

    g = torch.Generator().manual_seed(seed)
    groups = k // 16 if kind in (6, 7) else k // 32
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, groups, generator=g) * 0.01).half().float()
    d[0, 0] = 0.0  # a zero scale: its group is c alone
    c = (torch.randn(n, groups, generator=g) * 0.05) if kind in (5, 7) else None
    return Q8Weight(q, d, c)


@pytest.mark.parametrize("kind", [5, 6, 7])
@pytest.mark.parametrize("n,k", [(100, 576), (17, 64)])
def test_q8_family_matmul_matches_float64_reference(lib, kind, n, k):
    """Float32 activations: the weights expand to q * d (+ c), the product rounded first, as
    gguf's dequantizers compute them; the sums agree with float64 to float32 rounding."""
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul

    w = random_q8_family(n, k, kind, seed=n + kind)
    layer = NativeQ8Matmul(w, lib)
    assert layer.kind == kind
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(kind))
    torch.testing.assert_close(layer(x).double(), x.double() @ w.dequantize().double().T,
                               atol=1e-5, rtol=1e-5)


def int8_reference_half(x: torch.Tensor, w) -> torch.Tensor:
    """pd_i8_matmul's arithmetic in float64 for a q8-family weight of any kind: per half of 16
    (or per 32) an integer dot times d * sx, plus c times the exact sum of x."""
    m, k = x.shape
    group = 16 if w.is_half else 32
    xg = x.view(m, k // 32, 32)
    amax = xg.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv[..., None]).clamp(-128, 127).view(m, -1, group)
    sx = (amax / 127).double().repeat_interleave(32 // group, dim=1)  # [m, K / group]
    dots = torch.einsum("mgk,ngk->mng", xq.double(), w.q.double().view(w.q.shape[0], -1, group))
    y = (dots * (w.d.double()[None] * sx[:, None])).sum(dim=2)
    if w.c is not None:
        xs = x.view(m, -1, group).sum(dim=2).double()
        y = y + (w.c.double()[None] * xs[:, None]).sum(dim=2)
    return y


@pytest.mark.parametrize("kind", [5, 6, 7])
@pytest.mark.parametrize("n,k", [(100, 576), (16, 32)])
def test_int8_q8_family_matmul_matches_its_reference(vnni_lib, kind, n, k):
    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul

    w = random_q8_family(n, k, kind, seed=n + 10 * kind)
    layer = NativeQ8Matmul(w, vnni_lib, int8=True)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(kind))
    x[3] = 0.0
    y = layer(x).double()
    expected = int8_reference_half(x, w)
    scale = expected.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    assert ((y - expected).abs() / scale).max().item() < 1e-5
    exact = x.double() @ w.dequantize().double().T
    assert ((y - exact).norm() / exact.norm()).item() < 2e-2


def test_int8_half_packing_layout():
    """A half kind's d [N, K / 16] packs as [N / 16, K / 32, 2, 16]: (tile, group, half, col)."""
    q = torch.zeros(20, 64, dtype=torch.int8)
    d = torch.arange(20 * 4, dtype=torch.float32).view(20, 4)
    _, packed, _ = native.pack_q8_int8(q, d)
    assert packed.shape == (2, 2, 2, 16)
    t, g, h, col = 1, 1, 0, 3
    assert packed[t, g, h, col] == d[16 * t + col, 2 * g + h]
    assert torch.all(packed[1, :, :, 4:] == 0)


def test_int8_packing_layout():
    """Byte (tile, group, j, column, i) of the q4 packing holds k = 8j + i and 8j + 4 + i."""
    w = random_q4(20, 64, 0.0, seed=11)
    packed, d, _ = native.pack_q4_int8(w.q, w.d, w.m)
    assert packed.shape == (2, 2, 4, 16, 4) and d.shape == (2, 2, 16)
    t, g, j, col, i = 1, 1, 2, 3, 1
    n, k = 16 * t + col, 32 * g + 8 * j + i
    assert packed[t, g, j, col, i] == w.q[n, k] | (w.q[n, k + 4] << 4)
    assert d[t, g, col] == w.d[n, g]
    assert torch.all(packed[1, :, :, 4:] == 0)  # columns 20..31 do not exist: zero
    q8, _, _ = native.pack_q8_int8(torch.full((3, 32), -5, dtype=torch.int8), torch.ones(3, 1))
    assert q8.shape == (1, 1, 8, 16, 4) and q8[0, 0, :, :3].eq(123).all()


@pytest.mark.parametrize("kind", ["q4", "q8", "q8h", "q4-int8", "q8-int8", "q8h-int8"])
def test_matmul_rows_are_batch_and_thread_invariant(lib, kind):
    from engine_core.platforms.cpu.decode_quant import NativeQ4Matmul, NativeQ8Matmul

    int8 = kind.endswith("int8")
    if int8 and not native.has_int8(lib):
        pytest.skip("int8 activations are in the VNNI build only")
    w = random_q4(200, 576, 0.0, seed=7)
    layer = (NativeQ4Matmul(w, lib, int8) if kind.startswith("q4")
             else NativeQ8Matmul(random_q8_family(200, 576, 7, seed=7), lib, int8)
             if kind.startswith("q8h") else NativeQ8Matmul(w.dequantize(), lib, int8))
    assert_rows_invariant(layer, 576)


def assert_rows_invariant(layer, k: int) -> None:
    """A row's result is bit for bit the same in a batch of 37 on 2 threads, alone and
    permuted on 1."""
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(2))
    with torch_threads(2):
        batched = layer(x)
    with torch_threads(1):
        for i in (0, 9, 36):
            assert torch.equal(layer(x[i : i + 1]), batched[i : i + 1])
        perm = torch.randperm(37, generator=torch.Generator().manual_seed(3))
        assert torch.equal(layer(x[perm]), batched[perm])


@pytest.mark.parametrize("n,k", [(49152, 16), (1000, 16), (70, 1), (64, 64)])
def test_topk_matches_torch(lib, n, k):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(9, n, generator=g)
    x[1] = torch.arange(n, dtype=torch.float32)  # rising: every value raises the bar
    x[2] = 0.5  # all equal: the k lowest indices
    x[3, n // 2 :: 7] = 100.0  # ties at the top
    x[4] = -torch.arange(n, dtype=torch.float32)  # falling: the first k
    idx = native.topk(lib, x, k)
    values = x.gather(1, idx)
    expected = x.topk(k, dim=1)
    assert torch.equal(values, expected.values)  # the same values, largest first
    for r in range(9):  # equal values in index order
        for a, b in zip(idx[r, :-1].tolist(), idx[r, 1:].tolist(), strict=True):
            assert x[r, a] > x[r, b] or (x[r, a] == x[r, b] and a < b)
    assert torch.equal(idx[2], torch.arange(k))
    assert torch.equal(idx[4], torch.arange(k))
    assert torch.equal(native.topk(lib, x[5:6].contiguous(), k), idx[5:6])  # alone as batched
    with pytest.raises(ValueError, match="k <= min"):
        native.topk(lib, x, 65)


def test_add_rms_norm_matches_torch(lib):
    g = torch.Generator().manual_seed(8)
    x, res, w = torch.randn(7, 576, generator=g), torch.randn(7, 576, generator=g), torch.randn(576)
    expected_x = x + res
    expected = F.rms_norm(expected_x, (576,), w, 1e-5)
    y = native.add_rms_norm(lib, x, res, w, 1e-5)
    torch.testing.assert_close(x, expected_x, atol=0, rtol=0)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(native.add_rms_norm(lib, x[3:4].clone(), None, w, 1e-5), y[3:4])


def test_add_rms_norm_of_bf16_rows_rounds_as_the_bf16_reference(lib):
    """bfloat16 rows: the sum rounded to bf16 in place, then weight * bf16(normed row) as
    the model's bf16 RMSNorm reference computes it (decoder.py's torch path); within a float32
    rounding of the sum of squares of it, and a row is the same alone as batched, on 1 or
    2 threads."""
    g = torch.Generator().manual_seed(9)
    x, res = (torch.randn(40, 576, generator=g).bfloat16() for _ in range(2))
    w = (torch.randn(576, generator=g) * 0.5 + 1).bfloat16()
    expected_x = x + res
    expected = w * F.rms_norm(expected_x.float(), (576,), None, 1e-5).to(torch.bfloat16)
    got_x = x.clone()
    with torch_threads(2):
        y = native.add_rms_norm(lib, got_x, res, w, 1e-5)
    assert y.dtype == torch.bfloat16 and torch.equal(got_x, expected_x)
    ulps = (y.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 0.001
    with torch_threads(1):
        alone = native.add_rms_norm(lib, expected_x[5:6].clone(), None, w, 1e-5)
    assert torch.equal(alone, y[5:6])
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        native.add_rms_norm(lib, x, None, w.float(), 1e-5)
