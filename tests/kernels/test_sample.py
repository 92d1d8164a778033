"""pd_sample (kernels/csrc/sample.c) against the torch reference of its filters.

The kept set (what a row could draw) must equal the reference's for every filter and scale,
including nuclei far larger than the 64 candidates (the kernel must widen, not truncate) and
top-k beyond them; the draw itself is checked statistically in tests/engine_core. A row's token
is the same alone, batched and on 1 or 2 threads.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.sampler import apply_min_p, apply_top_k_top_p
from kernels import native
from tests.helpers import torch_threads
from tests.native_kernels import require_native_kernels, why_no_native_kernels

NO_NATIVE_KERNELS = why_no_native_kernels()
pytestmark = pytest.mark.skipif(NO_NATIVE_KERNELS is not None, reason=str(NO_NATIVE_KERNELS))


@pytest.fixture(params=native.cpu_isas())
def lib(request):
    return require_native_kernels(request.param)


def params_of(rows: int, temperature: float, top_k: int, top_p: float, min_p: float, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.full((rows,), temperature), torch.full((rows,), top_k, dtype=torch.int64),
            torch.full((rows,), top_p), torch.full((rows,), min_p),
            torch.rand(rows, dtype=torch.float64, generator=g))


def reference_kept(x: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float) -> torch.Tensor:
    """[rows, V] bool: the tokens the reference filters keep (float64, as the kernel sums),
    less those below e^-87 of the max, which the kernel weighs 0 (a probability < 1e-37)."""
    logits = x.double() / temperature
    logits[logits < logits.amax(dim=1, keepdim=True) - 87] = float("-inf")
    rows = x.shape[0]
    if top_k or top_p < 1:
        logits = apply_top_k_top_p(
            logits, torch.full((rows,), top_k) if top_k else None,
            torch.full((rows,), top_p, dtype=torch.float64) if top_p < 1 else None)
    if min_p > 0:
        apply_min_p(logits, torch.full((rows,), min_p, dtype=torch.float64))
    return logits.isfinite()


FILTERS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (1.0, 0, 0.95, 0.0),
    (0.7, 50, 1.0, 0.0),
    (0.7, 200, 0.9, 0.0),  # top-k past the candidates
    (1.0, 0, 1.0, 0.05),
    (1.3, 100, 0.8, 0.01),
    (1.0, 0, 0.5, 0.0),
    (0.5, 10, 0.3, 0.2),
]


@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0], ids=["flat", "mid", "peaked"])
@pytest.mark.parametrize("filters", FILTERS, ids=[str(f) for f in FILTERS])
def test_kept_set_matches_the_reference(lib, scale, filters):
    """Flat rows keep tens of thousands of tokens at top_p 0.95: far past the 64 candidates."""
    g = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(6, 49152, generator=g) * scale
    num_kept = torch.empty(6, dtype=torch.int64)
    ids = native.sample(lib, x.clone(), *params_of(6, *filters), num_kept)
    kept = reference_kept(x, *filters)
    assert num_kept.tolist() == kept.sum(dim=1).tolist()
    assert kept[torch.arange(6), ids].all()  # the drawn token is one the reference keeps


def test_a_large_nucleus_is_kept_whole(lib):
    """Nearly flat logits: the 0.95 nucleus holds ~95% of 49,152 tokens, not 64."""
    x = torch.zeros(2, 49152)
    x[:, :10] = 1.0
    num_kept = torch.empty(2, dtype=torch.int64)
    native.sample(lib, x.clone(), *params_of(2, 1.0, 0, 0.95, 0.0), num_kept)
    assert num_kept.tolist() == reference_kept(x, 1.0, 0, 0.95, 0.0).sum(dim=1).tolist()
    assert num_kept[0] > 46_000


def test_top_p_ties_keep_the_lower_indices(lib):
    """Equal probabilities: the nucleus is a prefix by index among them, as the reference."""
    x = torch.zeros(3, 1000)  # all equal: p = 0.25 keeps the first 250 tokens
    x[1, 500:] = float("-inf")  # 500 equal: p = 0.5 of them
    x[2, 0] = 5.0  # one clear winner, then 999 ties
    num_kept = torch.empty(3, dtype=torch.int64)
    for u in (0.0, 0.5, 0.999999):
        uniform = torch.full((3,), u, dtype=torch.float64)
        ids = native.sample(lib, x.clone(), torch.ones(3), torch.zeros(3, dtype=torch.int64),
                            torch.tensor([0.25, 0.5, 0.999]), torch.zeros(3), uniform,
                            num_kept)
        kept = reference_kept(x[:2], 1.0, 0, 0.25, 0.0)
        assert num_kept[0] == 250 and kept[0].sum() == 250 and ids[0] < 250
        assert num_kept[1] == 250 and ids[1] < 250
        assert ids[2] < 1000


def test_greedy_rows_blocked_tokens_and_extreme_draws(lib):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5000, generator=g)
    x[1, ::2] = float("-inf")  # blocked: never drawn, whatever u
    x[2, 4999] = 30.0
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0])
    for u in (0.0, 0.5, 1.0 - 2**-53):
        uniform = torch.full((4,), u, dtype=torch.float64)
        ids = native.sample(lib, x.clone(), temperature, torch.zeros(4, dtype=torch.int64),
                            torch.ones(4), torch.zeros(4), uniform)
        assert ids[0] == x[0].argmax()
        assert ids[1] % 2 == 1
        assert 0 <= ids[3] < 5000
    assert ids[2] == 4999  # e^-30 for the rest: the last token at u = 1 - 2^-53 too


def test_rows_are_batch_and_thread_invariant(lib):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 49152, generator=g) * 2
    args = (torch.linspace(0.5, 1.5, 16), torch.tensor([0, 50, 200, 0] * 4),
            torch.tensor([1.0, 0.9, 0.95, 0.5] * 4), torch.tensor([0.0, 0.0, 0.0, 0.05] * 4),
            torch.rand(16, dtype=torch.float64, generator=g))
    with torch_threads(2):
        batched = native.sample(lib, x.clone(), *args)
    with torch_threads(1):
        for r in range(16):
            one = native.sample(lib, x[r : r + 1].clone(), *(a[r : r + 1] for a in args))
            assert one.item() == batched[r].item()


def test_bad_arguments_raise(lib):
    x = torch.randn(2, 100)
    good = params_of(2, 1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="contiguous float32"):
        native.sample(lib, x.double(), *good)
    with pytest.raises(ValueError, match=r"\[rows\] parameters"):
        native.sample(lib, x, *good[:4], torch.rand(2))  # uniform must be float64
