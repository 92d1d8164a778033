"""The prefill rows' dense matmuls, made independent of the batch: a row's result is the same
bit for bit whatever else shares its call, as the C kernels' decode rows are.

torch's CPU matmuls choose their kernel, and with it the order a row's sums are added in, from
the call's shape. Measured on a 2-vCPU AVX-512 Xeon with AMX (torch 2.13): oneDNN's bf16 rows
changed once 33 or more rows shared a call (the AMX kernels), and once more between call sizes
above that; MKL's float32 rows changed from the second row on and with the thread count. A
prompt's KV and first token then depended on the prompts prefilled beside it, so a served
greedy output could differ from the offline engine's, and a stream moved to another decode
worker could continue differently.

- float32 (MKL): engine_core/openmp_env.py sets MKL_CBWR=AUTO,STRICT before MKL's first call,
  which makes a row independent of the call's size and of the thread count, at no measured
  cost. `float32_rows_vary` checks that it took effect.
- bf16 and other dtypes (oneDNN): no such mode, so every call gets one shape. A projection
  whose rows vary (`rows_vary` tries each shape once per process) multiplies its rows in
  calls of exactly `block_rows` rows, the last one padded with zeros: the most of
  BLOCK_ROWS at which a probe finds the rows independent of their position in the call, of
  the rows beside them and of the thread count, else ROWS, at which every projection shape
  tried was. The LM head takes HEAD_ROWS: its prefill rows are few (one per
  prompt that ends in the step) and its weight is large, so a call's cost is the weight's read.
- The other projections of those dtypes (RowBucketedLinear) keep one call, its rows rounded
  up to a bucket: oneDNN compiles a kernel per call shape and caches 1,024, which a model's
  row counts overflow.

Why per shape: at 128 and 256 rows per call, a 2048x640 projection's rows differed between
one thread and two; at 64 no shape tried did (tests/engine_core/test_prefill_rows.py). Most
other shapes of Gemma 3 270M and SmolLM2-135M kept their rows at 256 (SmolLM2's 1536x576 at
128), where a call of 256 rows took about half the time of four calls of 64
(docs/benchmarks.md, numerics).

Cost on that Xeon (bf16, 2 threads): each of torch's calls repacks its weight for AMX (64 rows
took 133 us with a prepacked 640x2048 weight, 187 us without), which a blocked projection's
packed weight (pack_weight) saves; rows still cost more in small calls: 640x2048
took 207 us per call of 64 rows, 144 us for 16 rows alone and 734 us for 512 rows in one call
(8 calls: 1.66 ms). Prefill of Gemma 3 270M took 1.2-1.6x as long as with torch's own calls
(docs/benchmarks.md, numerics). The head of a 262,144-token vocabulary took 27 ms for 16 rows
against 24 ms for one.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

ROWS = 64  # rows per call of a projection whose larger blocks vary (taken without a probe)
BLOCK_ROWS = (256, 128, ROWS)  # block_rows' candidates, the largest first
HEAD_ROWS = 16  # rows per call of the LM head
BUCKET_ROWS = 64  # the other projections' calls: rows rounded up to a multiple of this
BUCKET_SMALL = 16  # ... or of this, for calls of at most BUCKET_ROWS rows
PROBE_ROWS = (1, 2, 7, 33, 64, 65, 150, 511, 1024, 2048, 4096)  # rows_vary's call sizes
PROBE_TRUSTED = 2048  # rows a shape must be tried at to be left to torch's own calls
PROBE_MACS = 1 << 31  # multiply-adds of rows_vary's largest call, at most


class RowBlockedLinear(nn.Linear):
    """nn.Linear whose forward multiplies `rows` rows per call, the last call padded with
    zeros, so a row's result does not depend on the number of rows beside it. `is_packed`:
    the weight is oneDNN's reordered form for calls of `rows` rows (pack_weight), which each
    call of torch's own would otherwise reorder again."""

    rows = ROWS
    is_packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        m, b = x.shape[0], self.rows
        if m == 0:
            return x.new_zeros((0, self.out_features))
        if m == b:
            return self._call(x)
        whole = m - m % b
        parts = [self._call(x[i:i + b]) for i in range(0, whole, b)]
        if whole < m:
            tail = x.new_zeros((b, x.shape[1]))
            tail[:m - whole] = x[whole:]
            parts.append(self._call(tail)[:m - whole])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _call(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in_features]
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias,
                                                      "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack_weight(self) -> bool:
        """Replace the weight by oneDNN's form of it for calls of `rows` rows, where the
        packed calls give torch's own results bit for bit (packs_exactly). Only for a weight
        nothing else holds (no tied or shared storage): the caller checks. True if packed."""
        w = self.weight
        if self.is_packed or w.is_meta or not packs_exactly(
                self.in_features, self.out_features, w.dtype, self.bias is not None,
                self.rows):
            return False
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, self.rows),
                                   requires_grad=False)
        self.is_packed = True
        return True


class RowBucketedLinear(nn.Linear):
    """nn.Linear whose calls have a bucketed number of rows (`bucket_rows`), zeros added and
    their results dropped. oneDNN builds (JIT-compiles) a kernel for each call shape it has
    not met, and keeps the last 1,024 it built (its primitive cache): an engine's steps bring a
    new row count almost every step (the step's decode rows, a prefill chunk's tokens), so a
    model's projections overflow the cache and build kernels for good. On a 2-vCPU AVX-512
    Xeon, five projections of the tiny bench model's shapes, row counts uniform in 1..600
    (benchmarks/bench_row_counts.py): 3.9-4.7 ms per step in torch's own calls, in every pass
    over the same steps, against 0.6-1.0 ms bucketed (a 512 x 128 bf16 head took ~0.8 ms for
    a row count met the first time, ~0.05 ms after). Only for shapes whose rows do not vary
    (rows_vary): the added rows change nothing in the others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        m = x.shape[0]
        pad = bucket_rows(m) - m
        if pad == 0:
            return F.linear(x, self.weight, self.bias)
        return F.linear(torch.cat([x, x.new_zeros((pad, x.shape[1]))]), self.weight,
                        self.bias)[:m]


def bucket_rows(m: int) -> int:
    """The rows a RowBucketedLinear call of m rows makes: a multiple of BUCKET_SMALL up to
    BUCKET_ROWS rows, of BUCKET_ROWS above (at most 4 + rows / 64 shapes per projection)."""
    step = BUCKET_SMALL if m <= BUCKET_ROWS else BUCKET_ROWS
    return -(-m // step) * step


def block_prefill_rows(model: nn.Module) -> int:
    """Turn each of the model's nn.Linear whose rows torch's own calls would make depend on
    the rows beside them (`rows_vary`, for weights other than float32) into a RowBlockedLinear:
    the same module and parameters, the LM head with HEAD_ROWS rows per call; the others of
    those dtypes into a RowBucketedLinear. Returns how many were blocked."""
    head = model.lm_head
    head = getattr(head, "dense", head)  # the dense half of a DecodeQuantLMHead
    turned = 0
    holders = _storage_holders(model)
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dtype == torch.float32:
            continue
        if not rows_vary(module.in_features, module.out_features, module.weight.dtype,
                         module.bias is not None):
            module.__class__ = RowBucketedLinear
            continue
        module.__class__ = RowBlockedLinear
        module.rows = HEAD_ROWS if module is head else block_rows(
            module.in_features, module.out_features, module.weight.dtype,
            module.bias is not None)
        if module is not head and holders[_storage(module.weight)] == 1:
            module.pack_weight()  # (the head's is the embedding's too, where tied)
        turned += 1
    return turned


def _storage(t: torch.Tensor) -> int:
    return 0 if t.is_meta or t.is_mkldnn else t.untyped_storage().data_ptr()


def _storage_holders(model: nn.Module) -> Counter[int]:
    """How many of the model's tensors (parameters, buffers, other tensor attributes: the C
    kernels' views of a float weight) use each storage."""
    held: Counter[int] = Counter()
    for module in model.modules():
        tensors = {id(t): t for t in (*module._parameters.values(), *module._buffers.values(),
                                      *vars(module).values())
                   if isinstance(t, torch.Tensor)}
        held.update(_storage(t) for t in tensors.values())
    return held


@functools.cache
def packs_exactly(k: int, n: int, dtype: torch.dtype, has_bias: bool, rows: int) -> bool:
    """Whether calls of `rows` rows on oneDNN's packed form of a bf16 k -> n weight give
    F.linear's results bit for bit, on one thread, two and this process's count (tried on
    random weights once per process); False where torch has no such call."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    x = torch.randn(rows, k, generator=gen).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        with _thread_counts() as counts:
            for t in counts:
                torch.set_num_threads(t)
                if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none",
                                                                      [], ""),
                                   F.linear(x, w, bias)):
                    return False
    except (RuntimeError, AttributeError):  # no oneDNN build, or no such op in this torch
        return False
    return True


@functools.cache
def block_rows(k: int, n: int, dtype: torch.dtype, has_bias: bool) -> int:
    """The rows per call of a blocked k -> n projection: the largest of BLOCK_ROWS whose
    calls give each row the same result at any position in the call, beside any rows and on
    one thread, two or this process's count (tried once per process on random weights;
    only sizes within PROBE_MACS), else ROWS."""
    for b in BLOCK_ROWS[:-1]:
        if b * k * n <= PROBE_MACS and not _block_varies(k, n, dtype, has_bias, b):
            return b
    return ROWS


def _block_varies(k: int, n: int, dtype: torch.dtype, has_bias: bool, b: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    x = torch.randn(2 * b, k, generator=gen).to(dtype)
    h = b // 2
    with _thread_counts() as counts:
        torch.set_num_threads(1)
        ref = F.linear(x[:b], w, bias)
        for t in counts:
            torch.set_num_threads(t)
            moved = F.linear(x[:b].roll(5, 0), w, bias)  # each row 5 places on
            beside = F.linear(torch.cat([x[b:b + h], x[:h]]), w, bias)  # other rows first
            padded = F.linear(torch.cat([x[:h], torch.zeros_like(x[:h])]), w, bias)
            if not (torch.equal(F.linear(x[:b], w, bias), ref)
                    and torch.equal(moved, ref.roll(5, 0)) and torch.equal(beside[h:], ref[:h])
                    and torch.equal(padded[:h], ref[:h])):
                return True
    return False


@functools.cache
def rows_vary(k: int, n: int, dtype: torch.dtype, has_bias: bool) -> bool:
    """Whether torch's own calls may give a row of a k -> n projection a different result
    beside other rows than alone, or on one thread than on two or this process's count. Tried on
    random weights (the kernel depends on the shape, not the values) at PROBE_ROWS rows, from
    two offsets; a shape too large to try up to PROBE_TRUSTED rows within PROBE_MACS counts as
    varying. Small shapes, which oneDNN keeps off AMX, need no blocking: the tiny models'
    projections took ten times as long in calls of 64 rows."""
    counts = [m for m in PROBE_ROWS if m * k * n <= PROBE_MACS]
    if counts[-1] < PROBE_TRUSTED:
        return True
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    x = torch.randn(counts[-1] + 3, k, generator=gen).to(dtype)
    whole = F.linear(x[:counts[-1]], w, b)  # every row, in one call
    with _thread_counts() as threads:  # (a 1-thread worker decides as a 2-thread one)
        for t in threads:
            torch.set_num_threads(t)
            for m in counts:
                for start in (0, 3):
                    end = min(start + m, len(whole))
                    if not torch.equal(F.linear(x[start:start + m], w, b)[:end - start],
                                       whole[start:end]):
                        return True
    return False


@contextmanager
def _thread_counts() -> Iterator[list[int]]:
    """The thread counts a probe tries (1, 2 and this process's); torch's count is restored
    on leaving."""
    threads = torch.get_num_threads()
    try:
        yield sorted({1, 2, threads})
    finally:
        torch.set_num_threads(threads)


def float32_rows_vary() -> bool:
    """Whether torch's float32 matmul gives a row a different result beside other rows than
    alone: MKL without strict reproducibility (MKL_CBWR set after its first call)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 64, generator=gen)
    w = torch.randn(96, 64, generator=gen)
    alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(x.shape[0])])
    return not torch.equal(F.linear(x, w), alone)
