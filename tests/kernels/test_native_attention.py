"""The C kernels' row attention (pd_row_attention in kernels/csrc/attention.c: rope, the K/V
store and paged attention, for decode rows and for prefill rows one per token) against torch
references, on fresh random inputs.

A row's result is bit for bit the same alone, batched, permuted and on 1 or 2 threads. Every
test runs on each build this CPU can run (avx2, avx512 where it has AVX-512, avx512vnni where
it has VNNI too).
"""

from __future__ import annotations

import pytest
import torch

from engine_core.model.rope import apply_rope, cos_sin_cache
from kernels import native
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, store_kv_ref
from tests.helpers import torch_threads
from tests.kernels.attention_inputs import make_decode_inputs, make_prefill_inputs
from tests.native_kernels import require_native_kernels, why_no_native_kernels

# skipped only where the kernels cannot build or run; elsewhere a failed build fails each test
NO_NATIVE_KERNELS = why_no_native_kernels()
pytestmark = pytest.mark.skipif(NO_NATIVE_KERNELS is not None, reason=str(NO_NATIVE_KERNELS))


@pytest.fixture(params=native.cpu_isas())
def lib(request):
    return require_native_kernels(request.param)


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


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256)])
def test_decode_attention_over_a_bf16_cache(lib, heads, kv_heads, head_dim):
    """The default CPU dtype where bf16 is native: the cache is bf16, the kernel computes in
    float32 and stores the new K/V rounded to nearest even, as torch's conversion does.
    (4, 1, 256): Gemma 3 270M's shape, whose 4 heads share each key and value load."""
    qkv, cos_sin, kv32, slots, tables, ctx = decode_rows([1, 9, 40, 130], heads, kv_heads,
                                                         head_dim, 41)
    kv = kv32.to(torch.bfloat16)
    expected_cache = kv.float()
    scale = head_dim**-0.5
    expected = reference_decode(qkv.clone(), cos_sin, expected_cache, slots, tables, ctx, heads,
                                scale, torch.bfloat16)
    out = native.row_attention(lib, qkv, cos_sin, kv, slots, tables, ctx, heads, scale, 130)
    assert torch.equal(kv, expected_cache.to(torch.bfloat16))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "lens,heads,kv_heads,head_dim",
    [([1, 7, 16, 33, 100], 9, 3, 64), ([250, 5], 8, 8, 64), ([17, 64, 129], 4, 1, 128),
     ([3], 2, 2, 32), ([1, 12, 40, 97], 4, 2, 32), ([8, 65], 8, 2, 32), ([9, 70], 4, 1, 256), ([5, 40], 4, 2, 256), ([33], 2, 2, 256)],
)
def test_decode_attention_matches_reference(lib, lens, heads, kv_heads, head_dim):
    qkv, cos_sin, kv_layer, slots, tables, ctx = decode_rows(lens, heads, kv_heads, head_dim, 11)
    expected_cache = kv_layer.clone()
    scale = head_dim**-0.5
    expected = reference_decode(qkv.clone(), cos_sin, expected_cache, slots, tables, ctx, heads,
                                scale)
    out = native.row_attention(lib, qkv, cos_sin, kv_layer, slots, tables, ctx, heads, scale,
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
    out = native.row_attention(lib, *rows, 4, 0.125, 40)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_of_prefill_rows_matches_prefill_reference(lib, cache_dtype):
    """Prefill chunks after cached prefixes, one row per token, each row reading its sequence's
    block table through table_of_row (rows and lengths derived by AttentionMetadata): the
    causal varlen prefill attention, rope and K/V store of those tokens included."""
    query_lens, prefix_lens = [5, 40, 17, 1], [0, 23, 16, 70]
    inputs = make_prefill_inputs(query_lens, prefix_lens, 9, 3, 64, 16, torch.float32, seed=5)
    kv_layer = inputs.kv_layer.contiguous().to(cache_dtype)
    meta = inputs.metadata()
    positions = meta.prefill_row_lens.long() - 1
    expected_positions = torch.cat([torch.arange(p, p + q)
                                    for q, p in zip(query_lens, prefix_lens, strict=True)])
    assert torch.equal(positions, expected_positions)
    assert meta.prefill_max_len == 71
    tables = inputs.block_tables[meta.prefill_row_tables.long()]  # [T, max_blocks]
    slots = tables.long().gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(len(positions), 15 * 64, generator=g)
    cos_sin = cos_sin_cache(64, 4096, 10000.0, None)[positions]
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1)
    cos, sin = cos_sin[:, None, :32], cos_sin[:, None, 32:]
    expected_cache = kv_layer.float()
    store_kv_ref(apply_rope(k.reshape(-1, 3, 64), cos, sin), v.reshape(-1, 3, 64),
                 expected_cache, slots)
    expected_cache = expected_cache.to(cache_dtype)
    expected = paged_prefill_attention_ref(
        apply_rope(q.reshape(-1, 9, 64), cos, sin), expected_cache.float(), inputs.block_tables,
        inputs.query_start_loc, inputs.seq_lens, 0.125).reshape(len(positions), -1)
    out = native.row_attention(lib, qkv.clone(), cos_sin, kv_layer, slots,
                                  inputs.block_tables, meta.prefill_row_lens, 9, 0.125,
                                  meta.prefill_max_len, meta.prefill_row_tables)
    assert torch.equal(kv_layer, expected_cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # a row's result does not depend on the chunk around it: the last sequence's one row alone
    alone = native.row_attention(lib, qkv[-1:].clone(), cos_sin[-1:], kv_layer, slots[-1:],
                                    inputs.block_tables[-1:], meta.prefill_row_lens[-1:], 9,
                                    0.125, 71)
    assert torch.equal(alone, out[-1:])


def test_decode_attention_is_batch_and_thread_invariant(lib):
    lens = [5, 40, 77, 130, 16, 300, 9]
    qkv, cos_sin, kv_layer, slots, tables, ctx = decode_rows(lens, 9, 3, 64, 31)
    args = (kv_layer, slots, tables, ctx)

    def run(index, threads):
        with torch_threads(threads):
            return native.row_attention(lib, qkv[index].clone(), cos_sin[index], kv_layer,
                                           slots[index], tables[index], ctx[index], 9, 0.125,
                                           int(ctx[index].max()))

    all_rows = torch.arange(len(lens))
    batched = run(all_rows, 2)
    for i in range(len(lens)):
        assert torch.equal(run(torch.tensor([i]), 1), batched[i : i + 1])
    perm = torch.randperm(len(lens), generator=torch.Generator().manual_seed(0))
    assert torch.equal(run(perm, 1), batched[perm])
    del args


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_give_the_float32_call_between_torch_conversions(lib, cache_dtype, threads):
    """bfloat16 rows (pd_row_attention_bf16: a bf16 model's prefill rows) give bit for bit
    what torch's .float(), the float32 call and .to(torch.bfloat16) give, cache included; the
    rows passed in are left as they were. Prefill chunks and a group of 3 query heads (the
    group kernel), and 4 heads of one KV head (another)."""
    query_lens, prefix_lens = [5, 40, 17, 1], [0, 23, 16, 70]
    for hq, hkv in ((9, 3), (4, 1)):
        inputs = make_prefill_inputs(query_lens, prefix_lens, hq, hkv, 64, 16, torch.float32,
                                     seed=7)
        kv_layer = inputs.kv_layer.contiguous().to(cache_dtype)
        meta = inputs.metadata()
        positions = meta.prefill_row_lens.long() - 1
        tables = inputs.block_tables[meta.prefill_row_tables.long()]
        slots = (tables.long().gather(1, (positions // 16)[:, None])[:, 0] * 16
                 + positions % 16)
        g = torch.Generator().manual_seed(8)
        qkv = torch.randn(len(positions), (hq + 2 * hkv) * 64, generator=g).bfloat16()
        cos_sin = cos_sin_cache(64, 4096, 10000.0, None)[positions]
        args = (slots, inputs.block_tables, meta.prefill_row_lens, hq, 0.125,
                meta.prefill_max_len, meta.prefill_row_tables)
        with torch_threads(threads):
            want_cache = kv_layer.clone()
            want = native.row_attention(lib, qkv.float(), cos_sin, want_cache, *args)
            got_cache, given = kv_layer.clone(), qkv.clone()
            got = native.row_attention(lib, given, cos_sin, got_cache, *args)
        assert got.dtype == torch.bfloat16 and torch.equal(given, qkv)
        assert torch.equal(got, want.to(torch.bfloat16)), (hq, hkv)
        assert torch.equal(got_cache, want_cache)
