"""The garbage collector and the engine's long-lived heap.

CPython's cyclic collector walks every object it tracks in a full collection, and runs one
whenever the objects that survived since the last have grown to a quarter of the old ones. An
engine process holds ~270k tracked objects after start (torch, transformers, the model's
modules); serving creates far fewer that last (requests, their token lists), so on a 2-core
Zen 3 one full collection took 0.2-0.3 s, ~9 % of a 256-prompt `LLM.generate` of a tiny model,
nearly all of it spent walking objects that live as long as the process.

`gc.freeze()` moves every tracked object into a generation no collection walks (an O(1) list
splice; reference counting still frees them), as serving engines do after their start:

- a server process freezes once, when it is ready (`freeze_startup_heap`), for its life;
- `LLM.generate` freezes for the call only (`frozen_heap`): afterwards the objects are walked
  again, so an engine a program drops later is collected as before, cycles included.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # frozen_heap calls in progress
_frozen_for_life = False


def freeze_startup_heap() -> None:
    """A server at the end of its start: collect what start left behind (nothing found
    garbage later could free it once frozen), then freeze the rest for the process's life."""
    global _frozen_for_life
    gc.collect()
    with _lock:
        gc.freeze()
        _frozen_for_life = True


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within: every object alive at entry is out of the collector's walks. The first call to
    enter freezes, the last to leave unfreezes (calls on several threads nest), unless the
    process froze for life."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and not _frozen_for_life:
                gc.unfreeze()
