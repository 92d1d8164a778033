"""The engine's heap and the garbage collector (engine_core/heap.py): `LLM.generate` keeps what
was alive at its start out of the collector's walks for the call only, and a server freezes
once for its life."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from engine_core.heap import frozen_heap
from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.tiny_model import write_tiny_llama


class _Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen():
    assert gc.get_freeze_count() == 0, "another test left the heap frozen"
    yield
    assert gc.get_freeze_count() == 0


def test_a_cycle_dropped_within_the_call_is_collected_after_it():
    node = _Node()
    ref = weakref.ref(node)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: no collection walks it
        with frozen_heap():  # nested (another thread's call): still frozen when it leaves
            pass
        assert gc.get_freeze_count() > 0
    gc.collect()
    assert ref() is None


def test_generate_runs_on_a_frozen_heap_and_unfreezes_after(tmp_path, monkeypatch):
    llm = LLM(str(write_tiny_llama(tmp_path)), dtype="float32", num_kv_blocks=64)
    counts = []
    step_deltas = llm.engine.step_deltas

    def watched():
        counts.append(gc.get_freeze_count())
        return step_deltas()

    monkeypatch.setattr(llm.engine, "step_deltas", watched)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert counts and min(counts) > 0


def test_a_server_freezes_for_its_life():
    """freeze_startup_heap (run by the workers and the gateway as they become ready): a
    generate call later does not unfreeze what the start froze."""
    code = ("import gc\n"
            "from engine_core.heap import freeze_startup_heap, frozen_heap\n"
            "freeze_startup_heap()\n"
            "frozen = gc.get_freeze_count()\n"
            "with frozen_heap():\n"
            "    pass\n"
            "print(frozen > 0, gc.get_freeze_count() >= frozen)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["True", "True"]
