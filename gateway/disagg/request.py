"""One attempt of a request in the disaggregated backend (gateway/disagg/backend.py), as an
object with a named phase: what the backend knows of it so far, in one place.

    RESERVED   a decode worker is chosen and counts it in its in_flight: it holds the prompt's
               blocks (`reservation`, with the prefix it caches), or, a fork, it is the
               parent's decode worker (`parent`: no reservation of its own)
    PLACED     where the prompt is prefilled is decided (`decision.where`): "remote" (the
               prefill pool), "local" (the decode worker itself) or "fork" (the parent's KV)
    PREFILLED  remote only: a prefill worker pushed the KV and sampled the first token
               (`prefill_reply`); a local prefill or a fork runs on the decode worker, within
               DECODING
    DECODING   its start is sent on the decode worker's output stream (`call`: decode after a
               remote prefill, prefill_locally, or fork); its outputs stream back
    DONE       its finish arrived (or, aborted by the client before decoding, its abort)

    RESERVED -> PLACED -> [PREFILLED] -> DECODING -> DONE

A request that ends in any phase but DONE (cancelled, past its deadline, failed) is ended on
its decode worker: its call aborted on the output stream, or else its reservation aborted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.disagg.decode_stream import RequestChannel
from gateway.disagg.forks import Placement
from gateway.disagg.prefill_policy import PrefillDecision
from gateway.disagg.worker_pools import Worker
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.v1 import generate_pb2
from service_infra.backend import GenerateInput


class Phase(enum.Enum):
    RESERVED = "reserved"
    PLACED = "placed"
    PREFILLED = "prefilled"
    DECODING = "decoding"
    DONE = "done"


@dataclass
class DisaggRequest:
    """One attempt: `inp.req_id` is its id on the workers, `client_id` the gateway's (what
    abort() is called with)."""

    inp: GenerateInput
    client_id: str
    sampling: generate_pb2.SamplingParameters
    decode: Worker
    reservation: pb.ReserveResponse | None  # None: a fork, on its parent's blocks
    parent: Placement | None = None
    phase: Phase = Phase.RESERVED
    decision: PrefillDecision | None = None  # from PLACED
    # prefix blocks each prefill worker holds, by address: (in its pool, in its pool or tiers)
    held: dict[str, tuple[int, int]] | None = None
    t_placed: float = 0.0  # time.monotonic() when placed: the prefill's call starts
    prefill_reply: pb.PrefillResponse | None = None  # from PREFILLED (remote only)
    call: RequestChannel | None = None  # from DECODING
    # prompt tokens of a local prefill still to compute, counted in the decode worker's
    # num_local_tokens_in_flight until its first output
    num_local_tokens: int = 0
    num_output_tokens: int = 0
    t_first: float | None = None  # time.monotonic() of its first output
    prompt_logprobs: list | None = None  # the prefill's, handed out with the first chunk

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.inp.prompt_token_ids)

    def advance(self, phase: Phase) -> None:
        """The next phase, in order (PREFILLED only for a remote prefill)."""
        order = list(Phase)
        assert order.index(phase) > order.index(self.phase), (self.phase, phase)
        self.phase = phase
