"""Shared engine core of pdserve: model, paged KV cache, scheduler, sampler, offline API."""

from engine_core.outputs import CompletionOutput, RequestOutput
from engine_core.sampling_params import SamplingParams


def __getattr__(name: str):  # lazy: importing LLM pulls in torch and transformers
    if name == "LLM":
        from engine_core.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine_core.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams"]
