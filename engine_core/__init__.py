"""Shared engine core of pdserve: model, paged KV cache, scheduler, sampler, offline API."""

from typing import TYPE_CHECKING

# first: the OpenMP settings must be in the environment before anything loads torch
from engine_core import openmp_env  # noqa: F401 (imported for its effect)
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
