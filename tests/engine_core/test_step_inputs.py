"""The step's host arrays reach the device packed in one buffer and come back unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.platforms.device_check import DeviceCheck
from engine_core.step_inputs import StepUploader, pack, total_size, unpack


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "ids": rng.integers(0, 50000, 7).astype(np.int64),
        "tables": rng.integers(0, 1 << 30, (3, 5)).astype(np.int32),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "lens": np.array([-1, 2**40], dtype=np.int64),
    }


def test_pack_then_unpack_gives_every_array_back_with_its_shape_and_dtype():
    a = arrays()
    flat = np.empty(total_size(a) + 3, dtype=np.int64)  # larger than needed, as a reused buffer
    got = unpack(torch.from_numpy(flat), pack(a, flat))
    assert list(got) == list(a)
    for name, want in a.items():
        assert got[name].dtype == torch.from_numpy(want).dtype, name
        assert got[name].shape == want.shape, name
        assert np.array_equal(got[name].numpy(), want), name


def test_on_cpu_the_arrays_are_wrapped_without_a_copy():
    a = arrays()
    got = StepUploader(torch.device("cpu")).upload(a)
    for name, want in a.items():
        assert np.array_equal(got[name].numpy(), want)
    got["ids"][0] = -5
    assert a["ids"][0] == -5  # the same memory


@pytest.mark.gpu
def test_on_cuda_one_pinned_buffer_is_reused_across_steps():
    up = StepUploader(torch.device("cuda"), staged=True)
    first = arrays()
    got = up.upload(first)
    staging = up._staging
    assert staging.is_pinned()
    second = {k: v + 1 for k, v in arrays().items()}
    with DeviceCheck("cuda"):  # what the engine's step does: slicing pinned staging passes
        got2 = up.upload(second)
    assert up._staging is staging  # reused, and the first step's values were not clobbered
    for name in first:
        assert got[name].is_cuda and np.array_equal(got[name].cpu().numpy(), first[name])
        assert np.array_equal(got2[name].cpu().numpy(), second[name])
