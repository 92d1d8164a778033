"""Threads whose exceptions reach the test. threading.Thread only prints an uncaught exception
(pytest at most warns), so a test asserting after join() would pass without noticing, or fail
without the reason:

    threads = [CheckedThread(worker, k) for k in range(6)]
    for t in threads:
        t.start()
    join_checked(threads, timeout_s=30)  # AssertionError with each failed thread's traceback
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence


class CheckedThread(threading.Thread):
    """A daemon thread running `target(*args)`; `error` holds the formatted traceback of the
    exception it ended with, None while it runs and after it returned normally."""

    def __init__(self, target: Callable[..., object], *args: object) -> None:
        super().__init__(target=target, args=args, daemon=True)
        self.error: str | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException:
            self.error = traceback.format_exc()


def join_checked(threads: Sequence[CheckedThread], timeout_s: float | None = None) -> None:
    """Join every thread (all within `timeout_s` together); AssertionError naming each thread
    that raised, with its traceback, and each still running."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    running = [t.name for t in threads if t.is_alive()]
    errors = [f"{t.name}:\n{t.error}" for t in threads if t.error is not None]
    assert not errors and not running, (
        f"{len(errors)} thread(s) raised, {len(running)} still running {running}\n"
        + "\n".join(errors))
