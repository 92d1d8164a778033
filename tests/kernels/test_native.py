"""The C kernels (kernels/csrc/cpu_decode.c) against torch references, on fresh random inputs.

Each is also checked for batch invariance: a row's result is bit for bit the same alone,
batched, permuted and on 1 or 2 threads. Every test runs on each build this CPU can run (avx2,
and avx512 where it has AVX-512).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_core.model.rope import apply_rope, cos_sin_cache
from engine_core.weights.gguf_q4 import Q4Weight
from kernels import native
from kernels.reference import paged_decode_attention_ref, store_kv_ref
from kernels.testing import make_decode_inputs
from tests.helpers import torch_threads

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler or no AVX2/FMA here")


@pytest.fixture(params=native.cpu_isas())
def lib(request):
    return native.load(request.param)


def random_q4(n: int, k: int, offset: float, seed: int) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    return Q4Weight(
        q=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        d=torch.rand(n, k // 32, generator=g) * 0.02,
        m=torch.zeros(n, k // 32) if offset else torch.randn(n, k // 32, generator=g) * 0.1,
        offset=torch.full((n,), offset),
    )


def test_build_is_cached_by_source_version(tmp_path):
    first = native.build(tmp_path)
    assert first.exists() and native.build(tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    wide = native.build(tmp_path, isa="avx512")  # builds without the CPU having AVX-512
    assert wide != first and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.name, wide.name])


@pytest.mark.parametrize("offset", [8.0, 0.0], ids=["q4_0", "q4_1"])
@pytest.mark.parametrize("n,k", [(576, 576), (960, 576), (100, 1536)])
def test_q4_matmul_matches_dequantized_weights(lib, n, k, offset):
    from engine_core.model.decode_quant import NativeQ4Matmul

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
    from engine_core.model.decode_quant import NativeQ8Matmul

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


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_matmul_rows_are_batch_and_thread_invariant(lib, kind):
    from engine_core.model.decode_quant import NativeQ4Matmul, NativeQ8Matmul

    w = random_q4(200, 576, 0.0, seed=7)
    layer = NativeQ4Matmul(w, lib) if kind == "q4" else NativeQ8Matmul(w.dequantize(), lib)
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(2))
    with torch_threads(2):
        batched = layer(x)
    with torch_threads(1):
        for i in (0, 9, 36):
            assert torch.equal(layer(x[i : i + 1]), batched[i : i + 1])
        perm = torch.randperm(37, generator=torch.Generator().manual_seed(3))
        assert torch.equal(layer(x[perm]), batched[perm])


def decode_rows(context_lens, num_heads, num_kv_heads, head_dim, seed):
    """Random decode rows: qkv, cos|sin rows, a cache and slots for each row's new token."""
    inputs = make_decode_inputs(context_lens, num_heads, num_kv_heads, head_dim, 16,
                                torch.float32, seed=seed)
    kv_layer = inputs.kv_layer.contiguous()
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(context_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    positions = inputs.context_lens.long() - 1  # each row's token is its context's last
    blocks = inputs.block_tables.long().gather(1, (positions // 16)[:, None])[:, 0]
    slots = blocks * 16 + positions % 16
    cos_sin = cos_sin_cache(head_dim, 4096, 10000.0, None)[positions]  # [S, D]
    return qkv, cos_sin, kv_layer, slots, inputs.block_tables, inputs.context_lens


def reference_decode(qkv, cos_sin, kv_layer, slots, tables, lens, num_heads, scale,
                     cache_dtype=torch.float32):
    """float32 reference; the new K/V are rounded to cache_dtype as the cache stores them."""
    num_kv_heads, head_dim = kv_layer.shape[3], kv_layer.shape[4]
    rows = qkv.shape[0]
    half = head_dim // 2
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=1)
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    q = apply_rope(q.reshape(rows, num_heads, head_dim), cos, sin)
    k = apply_rope(k.reshape(rows, num_kv_heads, head_dim), cos, sin)
    store_kv_ref(k, v.reshape(rows, num_kv_heads, head_dim), kv_layer, slots)
    kv_layer.copy_(kv_layer.to(cache_dtype))
    return paged_decode_attention_ref(q, kv_layer, tables, lens, scale).reshape(rows, -1)


def test_decode_attention_over_a_bf16_cache(lib):
    """The default CPU dtype where bf16 is native: the cache is bf16, the kernel computes in
    float32 and stores the new K/V rounded to nearest even, as torch's conversion does."""
    qkv, cos_sin, kv32, slots, tables, ctx = decode_rows([1, 9, 40, 130], 9, 3, 64, 41)
    kv = kv32.to(torch.bfloat16)
    expected_cache = kv.float()
    expected = reference_decode(qkv.clone(), cos_sin, expected_cache, slots, tables, ctx, 9,
                                0.125, torch.bfloat16)
    out = native.decode_attention(lib, qkv, cos_sin, kv, slots, tables, ctx, 9, 0.125, 130)
    assert torch.equal(kv, expected_cache.to(torch.bfloat16))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "lens,heads,kv_heads,head_dim",
    [([1, 7, 16, 33, 100], 9, 3, 64), ([250, 5], 8, 8, 64), ([17, 64, 129], 4, 1, 128),
     ([3], 2, 2, 32)],
)
def test_decode_attention_matches_reference(lib, lens, heads, kv_heads, head_dim):
    qkv, cos_sin, kv_layer, slots, tables, ctx = decode_rows(lens, heads, kv_heads, head_dim, 11)
    expected_cache = kv_layer.clone()
    scale = head_dim**-0.5
    expected = reference_decode(qkv.clone(), cos_sin, expected_cache, slots, tables, ctx, heads,
                                scale)
    out = native.decode_attention(lib, qkv, cos_sin, kv_layer, slots, tables, ctx, heads, scale,
                                  max(lens))
    assert torch.equal(kv_layer, expected_cache) or torch.allclose(kv_layer, expected_cache,
                                                                   atol=1e-6, rtol=0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_decode_attention_sees_drafts_stored_in_the_same_call(lib):
    """Rows of one sequence at consecutive positions (a token and its drafts): each attends to
    the K/V the earlier rows store in this very call."""
    qkv, cos_sin, kv_layer, slots, tables, ctx = decode_rows([40], 4, 2, 64, 21)
    positions = torch.tensor([37, 38, 39])
    block = tables[0, 2].long()  # positions 32..47
    qkv = torch.randn(3, qkv.shape[1], generator=torch.Generator().manual_seed(4))
    rows = (qkv, cos_sin_cache(64, 4096, 10000.0, None)[positions], kv_layer,
            block * 16 + positions % 16, tables.expand(3, -1).contiguous(),
            (positions + 1).int())
    expected_cache = kv_layer.clone()
    expected = reference_decode(rows[0].clone(), rows[1], expected_cache, *rows[3:], 4, 0.125)
    out = native.decode_attention(lib, *rows, 4, 0.125, 40)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_decode_attention_is_batch_and_thread_invariant(lib):
    lens = [5, 40, 77, 130, 16, 300, 9]
    qkv, cos_sin, kv_layer, slots, tables, ctx = decode_rows(lens, 9, 3, 64, 31)
    args = (kv_layer, slots, tables, ctx)

    def run(index, threads):
        with torch_threads(threads):
            return native.decode_attention(lib, qkv[index].clone(), cos_sin[index], kv_layer,
                                           slots[index], tables[index], ctx[index], 9, 0.125,
                                           int(ctx[index].max()))

    all_rows = torch.arange(len(lens))
    batched = run(all_rows, 2)
    for i in range(len(lens)):
        assert torch.equal(run(torch.tensor([i]), 1), batched[i : i + 1])
    perm = torch.randperm(len(lens), generator=torch.Generator().manual_seed(0))
    assert torch.equal(run(perm, 1), batched[perm])
    del args


def test_add_rms_norm_matches_torch(lib):
    g = torch.Generator().manual_seed(8)
    x, res, w = torch.randn(7, 576, generator=g), torch.randn(7, 576, generator=g), torch.randn(576)
    expected_x = x + res
    expected = F.rms_norm(expected_x, (576,), w, 1e-5)
    y = native.add_rms_norm(lib, x, res, w, 1e-5)
    torch.testing.assert_close(x, expected_x, atol=0, rtol=0)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(native.add_rms_norm(lib, x[3:4].clone(), None, w, 1e-5), y[3:4])
