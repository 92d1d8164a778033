"""Shared engine core of pdserve: model, paged KV cache, scheduler, sampler, offline API."""

import os
from typing import TYPE_CHECKING

# OpenMP's idle threads (torch's and the C kernels', one libgomp) spin for GOMP_SPINCOUNT
# iterations after each parallel region before they sleep: 300,000 by default, a few hundred
# microseconds of a core per region gap, taken from the Python between two steps and from the
# stack's other processes. 3,000 still spans the gaps inside one C call; on a shared 2-core
# machine it halved a loaded batch-1 decode step and cut the offline engine's CPU per token
# by a third (docs/benchmarks.md, host cost per token). Set before torch loads libgomp; a
# user's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from engine_core.outputs import CompletionOutput, RequestOutput
from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:  # imported on first use at run time (__getattr__), named here for checkers
    from engine_core.engine import LLMEngine
    from engine_core.llm import LLM


def __getattr__(name: str):  # lazy: importing LLM pulls in torch and transformers
    if name == "LLM":
        from engine_core.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine_core.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams"]
