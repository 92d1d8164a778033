"""A request's state, shared by the scheduler, the KV cache manager and the model runner.

One token-counting model for every phase: `num_computed_tokens` catches up to `num_tokens`
(prompt + output so far). A fresh prompt, a chunked prefill, a decode step and a recompute
after preemption are all "compute the tokens in between".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine_core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved, prompt KV arriving from a prefill worker
    WAITING_FOR_PARENT = "waiting_for_parent"  # a fork: waits for its parent's prompt KV
    WAITING_FOR_OFFLOAD = "waiting_for_offload"  # blocks held, prefix KV loading from a tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


# (a tuple: `in` compares by identity first, where a set would call Enum's Python __hash__;
# read per token, it was ~0.3 us with the members looked up on each call)
_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Request:
    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        num_prior_output_tokens: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least 1 token, got 0")
        if not 0 <= num_prior_output_tokens < len(prompt_token_ids):
            raise ValueError(f"num_prior_output_tokens must be in [0, {len(prompt_token_ids)}) "
                             f"(the prompt's length), got {num_prior_output_tokens}")
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids) | frozenset(
            self.eos_token_ids
        )
        # the prompt's last tokens that an earlier attempt of this request generated (a
        # continuation on another worker): the penalties count them as output
        self.num_prior_output_tokens = num_prior_output_tokens
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        # SamplingParams.prompt_logprobs: entry j for prompt token j + 1 ({token: logprob},
        # the prompt token first, then the top-n), filled by the runner as the prefill runs
        self.prompt_logprobs: list[dict[int, float]] = []
        self.num_computed_tokens = 0
        # async scheduling: tokens launched steps sample for it that are not read yet (their
        # KV is counted in num_computed_tokens once scheduled)
        self.num_pending = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first schedule
        # offload tiers: looked up since its last admission or preemption; blocks loading;
        # (blocks the pool held, blocks the tiers held after them) of a lookup the pool had
        # no room for, not asked again while the pool's part is the same
        self.tiers_checked = False
        self.tier_hit: tuple[int, int] | None = None
        self.num_loading_blocks = 0
        self.num_preemptions = 0
        # speculative decoding: draft slots the scheduler granted this step, and the drafts
        # the proposer filled in (at most that many); both cleared when the step is done
        self.num_lookahead_tokens = 0
        self.spec_token_ids: list[int] = []
        # most prompt tokens one step computes for this request (None: the step's budget); a
        # decode worker's local prefill sets it so that running decodes never wait long
        self.max_chunk_tokens: int | None = None
        self.status = RequestStatus.WAITING
        self.times = RequestTimes()
        self.generator: torch.Generator | None = None
        # SamplingParams.structured's llguidance matcher (set by the engine, start_grammar):
        # it consumes every output token, so it always stands where the next token's mask
        # starts. A grammar that starts after a run of tokens (StructuredOutput.after_tokens)
        # waits in _pending_grammar until a token completes that run; matcher is None until
        # then.
        self.matcher = None
        self._pending_grammar = None
        self._after_tokens: tuple[int, ...] = ()
        self._grammar_from = 0  # output index of the grammar's first token
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @property
    def penalty_prompt_and_output(self) -> tuple[list[int], list[int]]:
        """(prompt, output) as the penalties see them: prior output counts as output."""
        split = self.num_prompt_tokens - self.num_prior_output_tokens
        return (self.prompt_token_ids[:split],
                self.prompt_token_ids[split:] + self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all computed yet (no prefix-cache hits then)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def max_drafts(self, k: int) -> int:
        """How many draft tokens this request may verify next step (0: decode plainly).

        Only a request in its decode phase drafts, and only when its sampling needs nothing
        that depends on every earlier token of the step (penalties, min_tokens blocking,
        logprobs) or that the verifier does not apply (logit_bias); the drafts never run past
        max_tokens. A structured output's drafts are checked against its grammar's masks; one
        that waits for its start token drafts nothing until it starts.
        """
        p = self.sampling_params
        if (k <= 0 or self.num_computed_tokens != self.num_tokens - 1
                or self._pending_grammar is not None  # unmasked drafts could pass its start
                or not self.output_token_ids or p.has_penalties
                or p.logprobs is not None or p.logit_bias
                or self.num_output_tokens < p.min_tokens):
            return 0
        return max(0, min(k, p.max_tokens - self.num_output_tokens - 1))

    def start_grammar(self, matcher, after_tokens: tuple[int, ...] = (),
                      prior: list[int] | None = None) -> bool:
        """Give the request its grammar's matcher: active now, or (after_tokens) held until
        a token completes that run. `prior`: a continuation's earlier output (in its
        prompt), replayed through it; False when the grammar rejects it."""
        if not after_tokens:
            self.matcher = matcher
        else:
            self._pending_grammar, self._after_tokens = matcher, after_tokens
            start = _end_of_run(prior or [], after_tokens)
            if start is not None:  # it started in the earlier attempt
                self.matcher, self._pending_grammar = matcher, None
                prior = prior[start:]
        if self.matcher is None or not prior:
            return True
        return self.matcher.consume_tokens(prior)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.matcher is None and self._pending_grammar is None:
            return
        if self.matcher is not None:
            # a token outside the mask leaves the matcher in its error state (never here:
            # the sampler only draws allowed tokens, and EOS ends the request)
            self.matcher.consume_token(token_id)
        elif (self._pending_grammar is not None and token_id == self._after_tokens[-1]
              and tuple(self.all_token_ids[-len(self._after_tokens):]) == self._after_tokens):
            self.matcher, self._pending_grammar = self._pending_grammar, None
            self._grammar_from = self.num_output_tokens

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (a stop string ended the
        request among tokens one speculative step produced). A grammar that started among
        the dropped tokens waits for its start token again."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]
            del self.output_logprobs[num_output_tokens:]
            if self.matcher is None:
                return
            consumed = self.num_output_tokens + drop - self._grammar_from
            self.matcher.rollback(min(drop, consumed))
            if self._after_tokens and num_output_tokens < self._grammar_from:
                self._pending_grammar, self.matcher = self.matcher, None

    def check_stop(self) -> RequestStatus | None:
        """Finish status after the latest token, or None to keep going (stop strings are
        checked on text, by the output processor)."""
        p = self.sampling_params
        num_out = len(self.output_token_ids)
        if num_out >= p.min_tokens and self.output_token_ids[-1] in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if num_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def _end_of_run(tokens: list[int], run: tuple[int, ...]) -> int | None:
    """The index just past the first occurrence of `run` in `tokens`; None if absent."""
    n = len(run)
    for end in range(n, len(tokens) + 1):
        if tuple(tokens[end - n:end]) == run:
            return end
    return None
