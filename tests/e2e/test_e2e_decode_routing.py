"""Decode-side prefix routing end to end: one `pdserve up --decode 2 --prefill-policy auto`
stack (1 prefill + 2 decode workers over shm, no Redis: decode workers publish the prefix
blocks they hold in Status). Two chats start at once, are prefilled by the prefill pool and
land on different decode workers; each later turn returns to the worker that holds its
history (its prompts' blocks and, by default, its replies' decode-computed ones), hits its
cache, is prefilled there, and gives the greedy output of an offline engine that kept its
replies too (conftest.py ref_chats).

The later turns go through a second gateway over the same workers, with
`--prefill-policy always-local`: it knows what each worker holds only from their Status. Under
`auto` a short follow-up's two costs are close once the decode worker has measured its own
(small, overhead-bound) prefills, so either side may win on this shared machine; a remote
prefill recomputes the replies' KV, which then differs from the decode-computed KV the
reference keeps (test_e2e_conditional.py checks `auto`'s choice of the local side)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_core.kv_cache.block_hash import hash_full_blocks
from gateway.disagg.routing import leading_overlap
from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.extra_gateway import ExtraGateway
from tests.e2e.stack import (
    BLOCK_SIZE,
    Stack,
    cacheable_tokens,
    greedy,
    out_ids,
    out_text,
    probe_decode_cache,
    run,
)

pytestmark = pytest.mark.slow

N = 12
REFRESH_WAIT_S = 2.5  # the gateway rereads the workers' Status every second
OPENERS = {
    "a": "I am planning a long walk along the coast next spring, starting from a small fishing "
         "village and following the cliffs north for about a week. What should I pack?",
    "b": "My sourdough bread keeps coming out dense and flat even though the starter bubbles "
         "nicely and I follow the recipe carefully. What could be going wrong with it?",
}
FOLLOW_UPS = ["Why?", "Give one more tip."]


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    start, stop = stack_factory
    s = start("--decode", "2", "--transport", "shm", "--prefill-policy", "auto")
    yield s
    stop(s)


@pytest.fixture(scope="module")
def local_gateway(stack) -> ExtraGateway:
    gw = ExtraGateway(stack, "--prefill-policy", "always-local")
    yield gw
    gw.stop()


def chat(conv: list[dict[str, str]]) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in conv]),
                              sampling=greedy(N))


def test_each_chat_returns_to_the_decode_worker_that_holds_its_history(stack, local_gateway,
                                                                       ref_chats):
    ref = ref_chats
    assert len(stack.decode) == 2
    convs = {k: [{"role": "user", "content": text}] for k, text in OPENERS.items()}
    # turn 1 of both at once: the gateway spreads them over the two decode workers
    with ThreadPoolExecutor(2) as pool:
        firsts = dict(zip(convs, pool.map(lambda c: run(stack.generation(), chat(c)),
                                          convs.values()), strict=True))
    holders = {}
    for k, msgs in firsts.items():
        expected = ref.chat(convs[k], N)
        assert out_ids(msgs) == expected.outputs[0].token_ids
        ids = expected.prompt_token_ids
        held = {a: probe_decode_cache(stack, a, ids) for a in stack.decode}
        # the chat template's opening block is shared; the whole prompt is on one worker
        holders[k] = max(held, key=held.get)
        assert held[holders[k]] == cacheable_tokens(len(ids)) > 2 * BLOCK_SIZE, held
        convs[k] += [{"role": "assistant", "content": out_text(msgs)}]
    assert holders["a"] != holders["b"], holders
    for turn, follow_up in enumerate(FOLLOW_UPS):
        for k in ("a", "b") if turn == 0 else ("a",):
            time.sleep(REFRESH_WAIT_S)  # the gateway learns what each worker holds
            history = ref.chat(convs[k][:-1], N).prompt_token_ids if turn == 0 else None
            convs[k] += [{"role": "user", "content": follow_up}]
            # what the holder publishes for routing covers the reply too, as its cache does
            ids = ref.tokenizer.apply_chat_template(convs[k])
            published = frozenset(stack.status_all()[holders[k]].prefix_block_hashes)
            published_tokens = leading_overlap(hash_full_blocks(ids, BLOCK_SIZE), published)
            msgs = run(local_gateway.stub, chat(convs[k]))
            expected = ref.chat(convs[k], N)
            assert expected.prompt_token_ids == ids
            assert published_tokens * BLOCK_SIZE == expected.num_cached_tokens, (k, turn)
            assert out_ids(msgs) == expected.outputs[0].token_ids
            assert out_text(msgs) == expected.outputs[0].text
            # its history was found where it was left: at least turn 1's whole blocks hit, and
            # as much as the offline engine that kept its replies found (the replies' too)
            cached = msgs[-1].usage.cached_prompt_tokens
            assert cached == expected.num_cached_tokens, (k, turn, cached)
            if history is not None:  # turn 1's prompt blocks and its reply's first block
                assert cached > cacheable_tokens(len(history)), (k, turn, cached)
            else:
                assert cached > 4 * BLOCK_SIZE, (k, turn, cached)
            t = msgs[-1].timing
            assert (t.prefill_where, t.prefill_reason) == ("local", "policy"), (k, turn, t)
            convs[k] += [{"role": "assistant", "content": out_text(msgs)}]
    # the workers' own answer: each chat's latest prompt is held by its first worker only
    for k in convs:
        ids = ref.chat(convs[k][:-1], N).prompt_token_ids
        held = {a: probe_decode_cache(stack, a, ids) for a in stack.decode}
        assert max(held, key=held.get) == holders[k], (k, held)
