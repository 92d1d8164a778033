"""How many threads a decode step runs on, chosen from the measured times of the choices.

A decode step of a small model is ~100 short OpenMP regions (pd_decode_layers: several per
layer), each ending at a barrier. When another process takes one of this machine's cores, the
region's other thread waits at every barrier for the descheduled one: a one-row Gemma 3 270M
step went from 9 ms on one thread to ~190 ms on two (docs/benchmarks.md, 2026-11-26). The right
count is whichever is faster *now*, which only a measurement can say, so the governor runs the
current count (first 1: a loaded machine's 2-thread step can take a second) and, every so
often, one step on the other, and keeps the faster:

    steps:    cur cur cur ... cur  PROBE  cur ...    (probe every `interval` steps)
    probe faster than the current's moving average by `margin`?  switch, interval -> min
    otherwise: interval doubles, and grows further until the probe's loss over the interval
               is at most `budget` of the steps' time; at most max_probe_interval

so a machine that stays loaded costs about `budget` in probes (a 1 s probe against 24 ms steps
waits ~800 steps), and one that frees up is found again within `max_probe_interval` steps.
The choices are 1 and max_threads.
Times are kept per kind of step (`key`, e.g. the number of decode rows), since a 32-row step
is compute-bound where a 1-row step waits on memory. Pure state: the caller sets the threads
and times the step (ModelRunner.execute). The C kernels' results do not depend on the thread
count (kernels/csrc/cpu_kernels.h), so switching never changes a token.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class _KeyState:
    current: int
    steps_until_probe: int
    interval: int
    avg_s: float | None = None  # moving average of the current count's step time
    probes: dict[int, float] = field(default_factory=dict)  # latest probe time per count


class ThreadGovernor:
    """Chooses 1 or max_threads threads per step (see the module docstring)."""

    def __init__(self, max_threads: int, min_probe_interval: int = 8,
                 max_probe_interval: int = 1024, alpha: float = 0.25, margin: float = 0.1,
                 budget: float = 0.05) -> None:
        if max_threads < 1 or not 1 <= min_probe_interval <= max_probe_interval:
            raise ValueError(f"ThreadGovernor: max_threads >= 1 and 1 <= min_probe_interval <= "
                             f"max_probe_interval, got {max_threads}, {min_probe_interval}, "
                             f"{max_probe_interval}")
        self.max_threads = max_threads
        self.min_probe_interval, self.max_probe_interval = min_probe_interval, max_probe_interval
        self.alpha, self.margin, self.budget = alpha, margin, budget
        self._states: dict[Hashable, _KeyState] = {}
        self.num_switches = 0

    @property
    def is_active(self) -> bool:
        return self.max_threads > 1

    def _other(self, threads: int) -> int:
        return 1 if threads == self.max_threads else self.max_threads

    def _state(self, key: Hashable) -> _KeyState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _KeyState(1, self.min_probe_interval,
                                                  self.min_probe_interval)
        return state

    def choose(self, key: Hashable) -> int:
        """The thread count for the next step of this kind."""
        state = self._state(key)
        if self.is_active and state.steps_until_probe <= 0 and state.avg_s is not None:
            return self._other(state.current)
        return state.current

    def record(self, key: Hashable, threads: int, seconds: float) -> None:
        """A step of this kind took `seconds` on `threads` threads (what choose said)."""
        state = self._state(key)
        if threads == state.current:
            state.avg_s = seconds if state.avg_s is None else (
                (1 - self.alpha) * state.avg_s + self.alpha * seconds)
            state.steps_until_probe -= 1
            return
        state.probes[threads] = seconds
        if state.avg_s is not None and seconds < (1 - self.margin) * state.avg_s:
            state.current, state.avg_s = threads, seconds
            state.interval = self.min_probe_interval
            self.num_switches += 1
        else:
            loss = 0.0 if state.avg_s is None else (seconds - state.avg_s) / (
                self.budget * max(state.avg_s, 1e-9))
            state.interval = min(max(2 * state.interval, math.ceil(loss)),
                                 self.max_probe_interval)
        state.steps_until_probe = state.interval

    def current(self, key: Hashable) -> int:
        """The count this kind of step runs on between probes."""
        return self._state(key).current
