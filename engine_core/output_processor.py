"""Detokenizes new tokens, applies stop strings and builds each step's RequestDeltas.

Stop strings are matched on text. While streaming, text that could still turn out to be the
start of a stop string is held back, so a client never sees part of a stop string. Every
request's cost per step is its new tokens' (a Rust detokenizer step each, see
tokenizer.StreamDetokenizer) and, with stop strings, a search of the text not yet handed out:
nothing grows with the length of its output.
"""

from __future__ import annotations

import time

from engine_core.outputs import RequestDelta
from engine_core.request import Request, RequestStatus
from engine_core.tokenizer import Tokenizer


class RequestTextState:
    def __init__(self, req: Request, tokenizer: Tokenizer | None, prompt: str | None) -> None:
        self.prompt = prompt
        p = req.sampling_params
        self.detok = (tokenizer.detokenizer(req.prompt_token_ids, p.skip_special_tokens)
                      if tokenizer is not None else None)
        self.stops = tuple(p.stop)
        self.max_stop_len = max(map(len, self.stops), default=0)
        self.text = ""  # with stop strings: all text decoded so far (a held-back tail too)
        self.pending = ""  # without: the text decoded since the last delta
        self.num_emitted = 0  # characters of `text` already handed to the client
        self.num_tokens_emitted = 0  # output tokens in deltas so far
        self.num_logprobs_emitted = 0
        self.num_pushed = 0  # output tokens detokenized so far
        self.stop_reason: str | int | None = None

    def push(self, new_ids: list[int]) -> bool:
        """Add tokens; True if a stop string ended the request."""
        if self.detok is None:
            return False
        piece = self.detok.push(new_ids)
        if not piece:
            return False
        self.text += piece
        if not self.stops:
            return False
        window_start = max(0, self.num_emitted - self.max_stop_len)
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


def advance_text(req: Request, state: RequestTextState) -> bool:
    """Detokenize the request's output tokens not seen yet; True when a stop string ends it
    (then the request's output is cut after the token that completed the stop string, and
    the caller finishes it). A stop token (EOS, stop_token_ids) that ended the request is not
    text, as in vLLM: its id ends token_ids, its text (kept special tokens show it) is left
    out."""
    out_ids = req.output_token_ids
    last = len(out_ids)
    if req.status is RequestStatus.FINISHED_STOPPED and last and out_ids[-1] in (
            req.stop_token_ids):
        last -= 1
    first = state.num_pushed
    if first >= last:
        return False
    if not state.stops:  # no stop strings: all of the step's tokens in one go
        state.num_pushed = last
        if state.detok is not None:
            state.pending += state.detok.push(out_ids[first:last])
        return False
    # one token at a time, so a stop string ends the output where a plain decode would
    for j in range(first, last):
        state.num_pushed += 1
        if state.push(out_ids[j : j + 1]):
            if req.is_finished:  # it ended anyway (its text is cut all the same)
                return False
            req.truncate_output(j + 1)
            return True
    return False


def make_delta(req: Request, state: RequestTextState, finished: bool) -> RequestDelta:
    """The request's news since its previous delta."""
    first_tokens = state.num_tokens_emitted
    out_ids = req.output_token_ids
    num_out = len(out_ids)
    if state.stops:
        text = state.take_delta(finished)
    else:  # nothing held back: all the text since the previous delta
        text, state.pending = state.pending, ""
    delta = RequestDelta(req.req_id, out_ids[first_tokens:], text, num_out, req=req)
    state.num_tokens_emitted = num_out
    p = req.sampling_params
    if p.logprobs is not None:
        delta.logprobs = req.output_logprobs[state.num_logprobs_emitted:]
        state.num_logprobs_emitted = len(req.output_logprobs)
    if first_tokens == 0:
        delta.is_first = True
        delta.num_cached_tokens = req.num_cached_tokens
        delta.prompt = state.prompt
        if p.prompt_logprobs is not None:
            delta.prompt_logprobs = [None, *req.prompt_logprobs]
    if finished:
        delta.finish_reason = req.status.value
        delta.stop_reason = state.stop_reason
        if delta.stop_reason is None and delta.finish_reason == "stop" and num_out:
            delta.stop_reason = out_ids[-1]
    if first_tokens == 0 or finished:
        delta.metrics = _metrics(req, finished)
    return delta
def _metrics(req: Request, finished: bool) -> dict[str, float]:
    t = req.times
    if finished and t.finished is None:
        t.finished = time.monotonic()
    return {k: v - t.arrival
            for k, v in (("first_scheduled", t.first_scheduled), ("first_token", t.first_token),
                         ("finished", t.finished))
            if v is not None}


def record_logprobs(out, rows: list[int], so,
                    which: list[tuple[int, int]] | None = None) -> None:
    """Append a step's sampled tokens' logprobs to their requests (rows: the sampled
    requests' indices in out.reqs, so's row j for rows[j]; which: (index, sample row) pairs
    to record, default all)."""
    ids = so.sampled_token_ids.tolist()
    lps = so.sampled_logprobs.tolist()
    top_ids = so.topk_token_ids.tolist() if so.topk_token_ids is not None else None
    top_lps = so.topk_logprobs.tolist() if so.topk_logprobs is not None else None
    for i, j in which if which is not None else ((i, j) for j, i in enumerate(rows)):
        req = out.reqs[i]
        n = req.sampling_params.logprobs
        if n is None:
            continue
        entry = {ids[j]: lps[j]}
        if top_ids is not None and n > 0:
            entry.update(zip(top_ids[j][:n], top_lps[j][:n], strict=True))
        req.output_logprobs.append(entry)
