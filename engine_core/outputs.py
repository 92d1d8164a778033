"""What the engine hands back.

Each step yields one `RequestDelta` per request that gained tokens (or ended): its new tokens,
new text, new logprobs and, on its last, why it ended. That is all a server streams, so the
per-step cost is the size of the step's news, never of a request's whole output (vLLM's
`EngineCoreOutput`). `RequestOutput`, shaped like vLLM's, is the whole output so far, folded
from the deltas for the offline API (`LLM.generate`, `LLMEngine.step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_core.request import Request


@dataclass(slots=True)
class RequestDelta:
    """One request's news from one step (or from admission: a first token computed
    elsewhere). Every field but `req` may be read from another thread once handed over."""

    req_id: str
    token_ids: list[int]  # new output tokens; a stop token that ends the request included
    text: str  # new text; text that may still be the start of a stop string is held back
    num_output_tokens: int  # output tokens so far, these included
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last, else None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[dict[int, float]] | None = None  # one per new token, when asked for
    # on the request's first delta: prompt tokens found in the prefix cache, the prompt's
    # logprobs (SamplingParams.prompt_logprobs: None first, vLLM's shape) and its text
    is_first: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt: str | None = None
    # on the first and the last: seconds since arrival of first_scheduled, first_token and
    # (the last) finished
    metrics: dict[str, float] | None = None
    # the engine's request: for the engine thread only (it keeps changing there)
    req: Request | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


class RequestOutputs:
    """Folds each request's deltas into its whole `RequestOutput` so far (the offline API).
    `add` returns the live output, which later deltas of the request keep changing until
    its last; `snapshot` copies it."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def add(self, delta: RequestDelta, prompt_token_ids: list[int]) -> RequestOutput:
        out = self._outputs.get(delta.req_id)
        if out is None:
            out = RequestOutput(delta.req_id, delta.prompt, prompt_token_ids,
                                [CompletionOutput(0, "", [], None)], False,
                                prompt_logprobs=delta.prompt_logprobs)
            self._outputs[delta.req_id] = out
        completion = out.outputs[0]
        completion.text += delta.text
        completion.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            completion.logprobs = completion.logprobs or []
            completion.logprobs.extend(delta.logprobs)
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = delta.stop_reason
        if delta.is_first:
            out.num_cached_tokens = delta.num_cached_tokens
        if delta.metrics is not None:
            out.metrics = dict(delta.metrics)
        out.delta_text, out.delta_token_ids = delta.text, delta.token_ids
        out.finished = delta.finished
        if out.finished:
            del self._outputs[delta.req_id]
        return out

    def discard(self, req_id: str) -> None:
        self._outputs.pop(req_id, None)


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy of an output whose lists the request's next delta does not change."""
    c = out.outputs[0]
    fields: dict[str, Any] = {**out.__dict__, "outputs": [CompletionOutput(
        c.index, c.text, list(c.token_ids), c.finish_reason,
        list(c.logprobs) if c.logprobs is not None else None, c.stop_reason)]}
    return RequestOutput(**fields)
