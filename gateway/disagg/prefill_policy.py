"""Where a prompt is prefilled: on the decode worker that will decode it (local) or on the
prefill pool (remote). A pure function of what the gateway knows once the decode worker has
reserved the prompt's blocks (and so told how much of it it caches).

Cost model, in seconds of latency summed over the requests it touches:

    remote = handoff_s                                  the extra hops, measured
           + (prefill_queue_tokens + n_remote) / prefill_tokens_per_s
           + n_load / load_tokens_per_s                 history loaded from its offload tiers
           + max(0, wire - n_remote / prefill_tokens_per_s)   the transfer the forward
             where wire = n_transfer * kv_bytes_per_token / transfer_bytes_per_s    leaves
    local  = (local_queue_tokens + n_local) / local_tokens_per_s     this request's TTFT,
           + num_chunks * decode_step_s                 its chunks sharing steps with decodes
           + decode_batch * n_local / local_tokens_per_s   the ITL added to each running decode

local_queue_tokens are local prefills already running on that decode worker: they share one
chunk per step (engine_core/scheduler.py), so this one waits for them.

n_local is what the decode worker lacks after its prefix-cache hit; n_remote what the prefill
worker computes (the whole prompt unless discovery knows its cache); n_load what it loads from
its offload tiers instead (engine_core/kv_offload/: blocks it stored there, published like its
pool's), at its measured load speed (free until it has loaded once); n_transfer the blocks
the decode worker lacks, the KV that would move. The prefill worker pushes each layer's KV as
it is computed, so the wire time overlaps the forward and only what outlasts it delays the
first token; transfer_bytes_per_s is the link's speed as the prefill worker's transfers saw
it (bytes over the time it was shipping: kv_transfer/send_options.py wire_seconds). The last
layer's share and the commit, which never overlap, are in handoff_s, learnt from the remote
requests' measured tail beyond this model. Every speed is measured live by the workers
(engine_core/stats.py, prefill_service/worker.py): none is configured. A decode worker that
has never prefilled is assumed as fast as the prefill pool (the same model and kernels).

The cheaper side wins (ties go remote, the path the pools are sized for). Overrides:
always-remote, always-local, and max_local_tokens, above which `auto` never prefills
locally. Without a measured prefill speed `auto` goes remote: the first remote prefills
measure it.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("auto", "always-remote", "always-local")
REASONS = ("policy", "max_local_tokens", "unmeasured", "cheaper_local", "cheaper_remote",
           "prompt_logprobs")  # the last: such a request always prefills remotely
DEFAULT_MAX_LOCAL_TOKENS = 1024
DEFAULT_LOCAL_CHUNK_TOKENS = 128  # a chunk step delays running decodes by ~this much prefill


@dataclass(frozen=True)
class PrefillPolicy:
    """The gateway's --prefill-policy and --local-prefill-max-tokens."""

    mode: str = "auto"
    max_local_tokens: int = DEFAULT_MAX_LOCAL_TOKENS
    local_chunk_tokens: int = DEFAULT_LOCAL_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"prefill policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.mode!r}")
        if self.max_local_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got "
                             f"{self.max_local_tokens}")
        if self.local_chunk_tokens < 1:
            raise ValueError(f"local_chunk_tokens must be >= 1, got {self.local_chunk_tokens}")


@dataclass(frozen=True)
class PrefillCosts:
    """What the gateway knows of one request and the two pools (speeds 0: not measured)."""

    num_local_tokens: int  # prompt tokens the decode worker lacks (after its cache hit)
    num_remote_tokens: int  # prompt tokens the prefill worker would compute
    num_transfer_tokens: int  # prompt tokens whose KV would move to the decode worker
    prefill_queue_tokens: int  # prompt tokens ahead on the prefill worker
    prefill_tokens_per_s: float  # the prefill pool's measured speed
    local_tokens_per_s: float  # the decode worker's measured prefill speed
    decode_batch: int  # requests decoding on the decode worker now
    decode_step_s: float  # its measured decode step
    transfer_bytes_per_s: float  # the transport's measured speed
    kv_bytes_per_token: int
    handoff_s: float = 0.0  # the remote path's measured extra: RPCs, commit, admission
    local_queue_tokens: int = 0  # prompt tokens of local prefills running on the decode worker
    num_remote_load_tokens: int = 0  # prompt tokens the prefill worker loads from its tiers
    remote_load_tokens_per_s: float = 0.0  # its measured tier load speed


@dataclass(frozen=True)
class PrefillDecision:
    where: str  # "local" or "remote"
    reason: str  # one of REASONS
    local_cost_s: float | None = None  # the model's estimates (None: not computed)
    remote_cost_s: float | None = None
    # what either side would compute (PrefillCosts'; None: not gathered)
    num_local_tokens: int | None = None
    num_remote_tokens: int | None = None

    def as_dict(self) -> dict:
        return {"where": self.where, "reason": self.reason,
                "local_cost_s": self.local_cost_s, "remote_cost_s": self.remote_cost_s,
                "num_local_tokens": self.num_local_tokens,
                "num_remote_tokens": self.num_remote_tokens}


def estimate(costs: PrefillCosts, chunk_tokens: int) -> tuple[float, float] | None:
    """(local, remote) cost in seconds; None while the prefill pool's speed is unmeasured."""
    if costs.prefill_tokens_per_s <= 0:
        return None
    local_speed = costs.local_tokens_per_s or costs.prefill_tokens_per_s
    n_local = costs.num_local_tokens
    ahead = costs.local_queue_tokens + n_local
    num_chunks = -(-ahead // chunk_tokens)
    local = (ahead / local_speed
             + (num_chunks * costs.decode_step_s if costs.decode_batch else 0.0)
             + costs.decode_batch * n_local / local_speed)
    transfer = exposed_transfer_s(costs.num_transfer_tokens * costs.kv_bytes_per_token,
                                  costs.transfer_bytes_per_s,
                                  costs.num_remote_tokens / costs.prefill_tokens_per_s)
    load = (costs.num_remote_load_tokens / costs.remote_load_tokens_per_s
            if costs.remote_load_tokens_per_s > 0 else 0.0)
    remote = (costs.handoff_s + transfer + load
              + (costs.prefill_queue_tokens + costs.num_remote_tokens) / costs.prefill_tokens_per_s)
    return local, remote


def exposed_transfer_s(num_bytes: float, link_bytes_per_s: float, overlap_s: float) -> float:
    """Seconds a layer-wise push of num_bytes adds after a forward of overlap_s: the wire time
    at the link's speed beyond the forward it overlaps (0 while the link is unmeasured)."""
    if link_bytes_per_s <= 0:
        return 0.0
    return max(0.0, num_bytes / link_bytes_per_s - overlap_s)


def decide(costs: PrefillCosts, policy: PrefillPolicy) -> PrefillDecision:
    """Local or remote for one request, and why."""
    if policy.mode == "always-remote":
        return PrefillDecision("remote", "policy")
    if policy.mode == "always-local":
        return PrefillDecision("local", "policy")
    if costs.num_local_tokens > policy.max_local_tokens:
        return PrefillDecision("remote", "max_local_tokens")
    est = estimate(costs, policy.local_chunk_tokens)
    if est is None:
        return PrefillDecision("remote", "unmeasured")
    local, remote = est
    if local < remote:
        return PrefillDecision("local", "cheaper_local", local, remote)
    return PrefillDecision("remote", "cheaper_remote", local, remote)
