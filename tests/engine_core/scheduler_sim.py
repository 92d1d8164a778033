"""A simulated engine for scheduler tests: token-id prompts, made-up sampled tokens, no model.

Each simulated step is `schedule()` then `update_from_output(out, sampled)`, with the KV cache
checked for integrity and every schedule() result checked against the scheduler's invariants.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_core.engine_config import SchedulerConfig
from engine_core.kv_cache.manager import KVCacheManager, cdiv
from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4
EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    return Scheduler(config, kv, max_model_len)


def make_req(req_id: str, num_prompt_tokens: int, first_token: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 4)
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Request(req_id, prompt, SamplingParams(**params), eos_token_ids=(EOS,))


def next_token(req: Request) -> int:
    """A made-up token that names its request and position: catches misplaced tokens."""
    return 1000 * (1 + int(req.req_id.lstrip("r"))) + req.num_output_tokens


def step(
    sched: Scheduler, token_for: Callable[[Request], int] = next_token
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step. Like the model runner, only requests that catch up sample a token."""
    out = sched.schedule()
    check_output(sched, out)
    sampled = [
        [token_for(r)] if r.num_computed_tokens + n == r.num_tokens else []
        for r, n in zip(out.reqs, out.num_scheduled_tokens, strict=True)
    ]
    advanced = sched.update_from_output(out, sampled)
    sched.kv.check_integrity()
    return out, advanced


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of every schedule() result."""
    assert out.total_num_tokens <= sched.config.max_num_batched_tokens
    assert len(out.reqs) <= sched.config.max_num_seqs
    assert sched.num_running <= sched.config.max_num_seqs
    assert len({r.req_id for r in out.reqs}) == len(out.reqs)
    assert out.num_scheduled_tokens[: out.num_decodes] == [1] * out.num_decodes
    for i, (r, n) in enumerate(zip(out.reqs, out.num_scheduled_tokens, strict=True)):
        # decodes lead; a decode is one token after the prompt (a prompt's last token is not)
        past_prompt = r.num_computed_tokens >= r.num_prompt_tokens
        assert (i < out.num_decodes) == (n == 1 + r.num_lookahead_tokens and past_prompt)
        assert r.status == RequestStatus.RUNNING
        assert 1 <= n <= r.num_tokens - r.num_computed_tokens
        # the request holds the slots for everything it computes this step
        assert len(sched.kv.block_ids(r.req_id)) >= cdiv(r.num_computed_tokens + n, BLOCK_SIZE)
    assert set(out.preempted_req_ids).isdisjoint(r.req_id for r in out.reqs)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        outs.append(step(sched)[0])
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_pool_full(sched: Scheduler) -> None:
    sched.kv.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert sched.kv.req_blocks == {}
