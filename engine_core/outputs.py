"""What the engine hands back, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}
    stop_reason: str | int | None = None  # the stop string or token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # seconds since arrival: first scheduled, first token, finished
    metrics: dict[str, float] = field(default_factory=dict)
    delta_text: str = ""  # text added by this step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
