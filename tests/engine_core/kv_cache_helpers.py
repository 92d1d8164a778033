"""What the KVCacheManager tests share: their block size, a request of token ids, and the
scheduler's bookkeeping after a step."""

from __future__ import annotations

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_req(req_id: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens))


def compute(kv: KVCacheManager, req: Request, num_tokens: int) -> None:
    """What the scheduler does after a step: the KV of the first num_tokens tokens exists."""
    req.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(req)

