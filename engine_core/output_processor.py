"""Detokenizes new tokens, applies stop strings and builds RequestOutputs.

Stop strings are matched on text. While streaming, text that could still turn out to be the
start of a stop string is held back, so a client never sees part of a stop string.
"""

from __future__ import annotations

from engine_core.outputs import CompletionOutput, RequestOutput
from engine_core.request import Request
from engine_core.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestTextState:
    def __init__(self, req: Request, tokenizer: Tokenizer | None, prompt: str | None) -> None:
        self.prompt = prompt
        p = req.sampling_params
        self.detok = (
            IncrementalDetokenizer(tokenizer, req.prompt_token_ids, p.skip_special_tokens)
            if tokenizer is not None else None
        )
        self.stops = tuple(p.stop)
        self.text = ""  # all text decoded so far (may include a held-back tail)
        self.num_emitted = 0  # characters of `text` already handed to the client
        self.num_tokens_emitted = 0
        self.num_pushed = 0  # output tokens detokenized so far
        self.stop_reason: str | int | None = None

    def push(self, new_ids: list[int]) -> bool:
        """Add tokens; True if a stop string ended the request."""
        if self.detok is None:
            return False
        self.text += self.detok.push(new_ids)
        if not self.stops:
            return False
        window_start = max(0, self.num_emitted - max(len(s) for s in self.stops))
        best = None
        for s in self.stops:
            at = self.text.find(s, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_reason = best[1]
            return True
        return False

    def take_delta(self, finished: bool) -> str:
        end = len(self.text)
        if not finished and self.stops:
            end -= _held_back(self.text, self.stops)
        end = max(end, self.num_emitted)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def build_output(req: Request, state: RequestTextState, finished: bool) -> RequestOutput:
    reason = req.status.value if finished else None
    stop_reason = state.stop_reason
    if finished and stop_reason is None and reason == "stop" and req.output_token_ids:
        stop_reason = req.output_token_ids[-1]
    delta_ids = req.output_token_ids[state.num_tokens_emitted :]
    state.num_tokens_emitted = req.num_output_tokens
    t = req.times
    metrics = {
        k: v - t.arrival
        for k, v in (("first_scheduled", t.first_scheduled), ("first_token", t.first_token),
                     ("finished", t.finished))
        if v is not None
    }
    logprobs = req.output_logprobs if req.sampling_params.logprobs is not None else None
    delta_text = state.take_delta(finished)
    return RequestOutput(
        request_id=req.req_id,
        prompt=state.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[CompletionOutput(0, state.text[: state.num_emitted],
                                  list(req.output_token_ids), reason, logprobs, stop_reason)],
        finished=finished,
        num_cached_tokens=req.num_cached_tokens,
        metrics=metrics,
        delta_text=delta_text,
        prompt_logprobs=([None, *req.prompt_logprobs]
                         if req.sampling_params.prompt_logprobs is not None else None),
        delta_token_ids=delta_ids,
    )
