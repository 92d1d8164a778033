"""The decode steps' thread count (engine_core/thread_governor.py): a pure state machine fed
with made-up step times."""

from __future__ import annotations

import pytest

from engine_core.thread_governor import ThreadGovernor


def run(gov: ThreadGovernor, key, times: dict[int, float], steps: int) -> list[int]:
    """`steps` steps whose time depends only on the thread count; the counts used."""
    used = []
    for _ in range(steps):
        threads = gov.choose(key)
        gov.record(key, threads, times[threads])
        used.append(threads)
    return used


def test_a_quiet_machine_goes_to_every_thread_and_probes_less_and_less():
    gov = ThreadGovernor(2, min_probe_interval=4, max_probe_interval=32, budget=1.0)
    used = run(gov, "k", {1: 0.020, 2: 0.012}, 200)
    assert used[:6] == [1, 1, 1, 1, 2, 2] and gov.num_switches == 1  # starts safe, on one
    probes = [i for i, t in enumerate(used) if t == 1 and i > 4]
    # after the switch, lost probes' intervals double: 4, 8, 16, then 32 at most
    assert [b - a for a, b in zip(probes, probes[1:], strict=False)][:4] == [9, 17, 33, 33]
    assert gov.current("k") == 2


def test_a_loaded_machine_goes_to_one_thread_and_back_when_it_frees_up():
    gov = ThreadGovernor(2, min_probe_interval=4, max_probe_interval=64)
    run(gov, "k", {1: 0.020, 2: 0.012}, 10)
    assert gov.current("k") == 2
    run(gov, "k", {1: 0.020, 2: 0.190}, 16)  # another process took a core
    assert gov.current("k") == 1 and gov.num_switches == 2
    used = run(gov, "k", {1: 0.020, 2: 0.190}, 200)
    # a lost probe costs 0.17 s: the next waits for 0.17 / (5 % of 0.02) = 170 steps (at
    # most 64 here), so the probes cost about the budget
    assert used.count(2) <= 200 // 64 + 1
    run(gov, "k", {1: 0.020, 2: 0.012}, 70)  # the core is free again
    assert gov.current("k") == 2


def test_kinds_of_step_are_timed_apart_and_one_thread_never_probes():
    gov = ThreadGovernor(2, min_probe_interval=2)
    run(gov, 1, {1: 0.010, 2: 0.050}, 4)
    run(gov, 6, {1: 0.200, 2: 0.120}, 4)
    assert gov.num_switches == 1
    assert (gov.current(1), gov.current(6)) == (1, 2)
    single = ThreadGovernor(1)
    assert not single.is_active and set(run(single, 1, {1: 0.01}, 50)) == {1}
    with pytest.raises(ValueError):
        ThreadGovernor(0)
