"""Speculative decoding with disaggregation: a `pdserve up --speculative ngram` stack (the
decode worker drafts by prompt lookup and verifies) gives exactly the offline engine's greedy
output, for text, code and chat, streamed through gRPC, and leaves both pools full."""

from __future__ import annotations

import pytest

from protos.pdserve.v1 import generate_pb2 as pb
from tests.e2e.stack import PROMPTS, check_greedy_chat, check_greedy_text, greedy, out_ids, run

pytestmark = pytest.mark.slow

# a prompt the output copies from: the n-gram proposer finds its drafts here
COPY = ("Repeat the list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs, "
        "dates, kiwis. Again: apples, pears, plums,")


@pytest.fixture(scope="module")
def stack(spec_stack):
    return spec_stack


@pytest.mark.parametrize("name", list(PROMPTS))
def test_speculative_greedy_matches_offline_engine(stack, ref, name):
    check_greedy_text(stack, ref, PROMPTS[name])


def test_speculative_chat_matches_offline_engine(stack, ref):
    check_greedy_chat(stack, ref)


def test_copying_output_matches_offline_engine(stack, ref):
    msgs = run(stack.generation(), pb.GenerateRequest(text=COPY, sampling=greedy(40)))
    assert out_ids(msgs) == ref.generate(COPY, 40).outputs[0].token_ids
    # the decode worker drafted and had drafts accepted (per position, via the gateway)
    spec = stack.gateway_status()["speculative"]
    assert spec["num_drafts"][0] > 0 and spec["num_accepted"][0] > 0, spec
    assert len(spec["acceptance_rate_per_position"]) == 4
