"""The interface between the gateway's front ends (gRPC, HTTP) and whatever runs the model.

    front end --GenerateInput--> Backend.generate() --GenerateChunk...--> front end

A front end validates and tokenizes a request into a `GenerateInput`, then iterates
`backend.generate(inp)`: each `GenerateChunk` carries the tokens and text produced since the
previous one; the last has `finish_reason` set, the usage and a `Timing`. Two backends
implement it: `ColocatedBackend` (the engine in this process, service_infra/colocated.py) and
the gateway's disaggregated one (prefill and decode pools behind gRPC). The prefill and decode
workers run their engines through `ColocatedBackend` too, so these types and errors live below
the gateway and both services.

Contract of `generate`, for every backend:
- Cancelling the consuming task (client gone, server shutdown) or closing the iterator before
  the last chunk aborts the request in the backend and frees everything it held. Front ends
  consume under `contextlib.aclosing` so that breaking out of the loop closes it at once.
- When `inp.deadline` passes first, the backend aborts the request and raises
  `DeadlineExceeded`.
- `abort(req_id)` from elsewhere ends that request's stream with a last chunk whose
  `finish_reason` is "abort".
- Bad input that validation let through raises `ValueError`; a reused running `req_id` raises
  `DuplicateRequestError`; a backend that cannot serve (closed, engine failure, no worker)
  raises `BackendUnavailable`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_core.tokenizer import Tokenizer

FINISH_REASONS = ("stop", "length", "abort")


class DuplicateRequestError(ValueError):
    """A request with this id is already running."""


class BackendUnavailable(RuntimeError):
    """The backend cannot serve the request (closed, failed, or no worker left)."""


class Overloaded(RuntimeError):
    """The request was not admitted: queues are full or capacity did not free up in time
    (RESOURCE_EXHAUSTED, HTTP 429). The message says which bound."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before it finished; it was aborted."""


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what clients pass as `model`, and what responses say
    max_model_len: int  # prompt + generated tokens of one request, at most
    vocab_size: int  # token ids must be smaller
    aliases: tuple[str, ...] = ()  # other names clients may pass (--served-model-name)

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class GenerateInput:
    """One validated, tokenized request."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # the text the ids came from, when there was one
    deadline: float | None = None  # time.monotonic() by which to finish; None: no deadline
    arrival: float = field(default_factory=time.monotonic)  # when the gateway received it
    # the prompt's last tokens that an earlier attempt generated (a continuation after a lost
    # worker): the penalties count them as output
    num_prior_output_tokens: int = 0
    # another sample of the same prompt (OpenAI `n`), started first: this one shares its
    # prompt KV instead of computing it (engine_core/scheduler.py's forks). A hint: when that
    # request is gone or unknown to the backend, this one runs on its own
    fork_of: str | None = None


@dataclass(frozen=True)
class Timing:
    """Where a request's time went, in seconds since its arrival at the gateway (see the
    Timing message in protos/pdserve/v1/generate.proto): ttft_s = queue_s + prefill_s +
    kv_transfer_s."""

    queue_s: float  # arrival -> first scheduled for prefill
    prefill_s: float  # first scheduled -> first token sampled
    kv_transfer_s: float  # first token sampled -> delivered where it decodes (0 colocated)
    first_decode_step_s: float  # ready to decode -> second token (0 if only one token)
    ttft_s: float  # arrival -> first token
    total_s: float  # arrival -> end
    # where the prompt was prefilled ("remote", "local" or "colocated") and why
    # (gateway/disagg/prefill_policy.py's reasons; "" colocated)
    prefill_where: str = "colocated"
    prefill_reason: str = ""


@dataclass
class GenerateChunk:
    """What one request produced since the previous chunk."""

    token_ids: list[int]
    text_delta: str  # may lag token_ids (incomplete UTF-8, possible stop string held back)
    # one dict per token in token_ids: {token id: logprob}, the sampled token first, then the
    # top-n alternatives; None unless the request asked for logprobs
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # one of FINISH_REASONS on the last chunk, else None
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far, this chunk included
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    timing: Timing | None = None  # on the last chunk
    # SamplingParams.prompt_logprobs: on the first chunk, one per prompt token, None first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


class Backend(Protocol):
    """Runs validated requests. All methods are called from the gateway's event loop."""

    model: ModelInfo
    tokenizer: Tokenizer  # what validation tokenizes and applies the chat template with

    def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks (an async generator); see the module docstring."""
        ...

    async def abort(self, req_id: str) -> bool:
        """Abort a running request; False if none with this id runs. Idempotent."""
        ...

    async def status(self) -> dict[str, Any]:
        """A JSON-able snapshot for introspection and tests: at least num_running,
        num_waiting, num_free_blocks and num_blocks (summed over pools when there are
        several)."""
        ...

    async def close(self) -> None:
        """Abort whatever still runs and release the backend's resources. Idempotent."""
        ...
