"""Workloads: exact token lengths, text that encodes to the same ids, the shipped data."""

from __future__ import annotations

import pytest

from pdserve.bench.workloads import (
    WorkloadConfig,
    build_workload,
    shipped_code_edits,
    shipped_prompts,
)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(str(model_path)))


def test_shipped_data():
    prompts = shipped_prompts()
    assert len(prompts) >= 60 and len(set(prompts)) == len(prompts)
    edits = shipped_code_edits()
    assert len(edits) >= 10 and all("```" in e for e in edits)


@pytest.mark.parametrize("name", ["fixed", "random", "shared-prefix", "mixed"])
def test_plain_prompts_are_token_exact(tokenizer, name):
    w = build_workload(WorkloadConfig(name=name, num_prompts=12, input_len=40, output_len=8,
                                      prefix_len=64, num_long=2, long_input_range=(300, 400)),
                       tokenizer)
    for reqs in w.values():
        for r in reqs:
            assert len(r.prompt_ids) == r.input_len
            # the text sent over HTTP is the same prompt as the ids sent over gRPC
            assert tokenizer.encode(r.prompt_text) == list(r.prompt_ids)
            assert r.ignore_eos


def test_lengths_per_workload(tokenizer):
    fixed = build_workload(WorkloadConfig("fixed", num_prompts=5, input_len=33, output_len=7),
                           tokenizer)["main"]
    assert [(r.input_len, r.output_len) for r in fixed] == [(33, 7)] * 5
    assert len({r.prompt_ids[:8] for r in fixed}) == 5  # distinct from the first block
    rnd = build_workload(WorkloadConfig("random", num_prompts=50, input_len=100,
                                        output_len=20, range_ratio=0.5), tokenizer)["main"]
    assert all(50 <= r.input_len <= 150 and 10 <= r.output_len <= 30 for r in rnd)
    assert len({r.input_len for r in rnd}) > 10
    shared = build_workload(WorkloadConfig("shared-prefix", num_prompts=4, input_len=20,
                                           prefix_len=64), tokenizer)["main"]
    assert len({r.prompt_ids[:64] for r in shared}) == 1
    assert len({r.prompt_ids[64:] for r in shared}) == 4
    mixed = build_workload(WorkloadConfig("mixed", num_prompts=3, num_long=2,
                                          long_input_range=(1000, 1200), long_output_len=4),
                           tokenizer)
    assert [r.group for r in mixed["decode"]] == ["decode"] * 3
    assert all(1000 <= r.input_len <= 1200 and r.output_len == 4 for r in mixed["long"])


def test_chat_workloads(tokenizer):
    prompts = build_workload(WorkloadConfig("prompts", num_prompts=70), tokenizer)["main"]
    assert len({r.messages for r in prompts}) == len(shipped_prompts())  # every one, cycled
    assert all(r.output_len == 128 and not r.ignore_eos for r in prompts)
    edits = build_workload(WorkloadConfig("code-edit", num_prompts=3), tokenizer)["main"]
    for r in edits:
        assert r.input_len == len(tokenizer.apply_chat_template(
            [{"role": "user", "content": r.messages[0][1]}]))
        assert r.output_len > 48  # the code's own length and some room


def test_seeded_and_validated(tokenizer):
    a = build_workload(WorkloadConfig("random", num_prompts=6, seed=3), tokenizer)
    b = build_workload(WorkloadConfig("random", num_prompts=6, seed=3), tokenizer)
    c = build_workload(WorkloadConfig("random", num_prompts=6, seed=4), tokenizer)
    assert a == b and a != c
    with pytest.raises(ValueError, match="workload must be one of"):
        WorkloadConfig("sharegpt")
    with pytest.raises(ValueError, match="range_ratio"):
        WorkloadConfig(range_ratio=1.0)


def test_multi_turn_conversations(tokenizer):
    from pdserve.bench.workloads import FOLLOW_UPS, OPENERS

    cfg = WorkloadConfig("multi-turn", num_prompts=20, seed=3)
    chats = build_workload(cfg, tokenizer)["main"]
    assert chats == build_workload(cfg, tokenizer)["main"]  # deterministic for a seed
    assert len(chats) == 20 and len({c.messages for c in chats}) == 20  # tagged: distinct
    turns = [1 + len(c.follow_ups) for c in chats]
    assert min(turns) >= 4 and max(turns) <= 8 and len(set(turns)) > 2
    for c in chats:
        (role, content), = c.messages
        assert role == "user" and any(content.endswith(o) for o in OPENERS)
        assert set(c.follow_ups) <= set(FOLLOW_UPS)
        assert (c.group, c.output_len, c.ignore_eos) == ("first-turn", 32, False)
        assert c.input_len == len(tokenizer.apply_chat_template([{"role": "user",
                                                                   "content": content}]))
    nxt = chats[0].next_turn("An answer.", chats[0].follow_ups[0])
    assert nxt.messages == (*chats[0].messages, ("assistant", "An answer."),
                            ("user", chats[0].follow_ups[0]))
    assert (nxt.group, nxt.follow_ups, nxt.output_len) == ("follow-up", (), 32)
def test_multi_turn_with_long_histories(tokenizer):
    """--history-len: each chat opens with a document of that many tokens, distinct per chat;
    a bad range is refused naming the field."""
    from pdserve.bench.workloads import OPENERS

    cfg = WorkloadConfig("multi-turn", num_prompts=4, seed=1, history_len=(300, 400))
    chats = build_workload(cfg, tokenizer)["main"]
    assert chats == build_workload(cfg, tokenizer)["main"]
    short = build_workload(WorkloadConfig("multi-turn", num_prompts=4, seed=1),
                           tokenizer)["main"]
    for c, s in zip(chats, short, strict=True):
        (_, content), = c.messages
        assert any(content.endswith(o) for o in OPENERS)
        # the document (300-400 tokens) and the template's head come before the opener
        assert 300 + s.input_len - 10 <= c.input_len <= 400 + s.input_len
    assert len({c.messages[0][1][:200] for c in chats}) == 4  # distinct documents
    with pytest.raises(ValueError, match="history_len must be 1 <= low <= high"):
        WorkloadConfig("multi-turn", history_len=(400, 300))


def test_structured_workload_pairs_constrained_and_plain_chats(tokenizer):
    import json

    import jsonschema

    from pdserve.bench.workloads import STRUCTURED_SCHEMA

    w = build_workload(WorkloadConfig(name="structured", num_prompts=5), tokenizer)
    plain, constrained = w["unconstrained"], w["json-schema"]
    assert len(plain) == len(constrained) == 5
    for p, c in zip(plain, constrained, strict=True):
        # the same question, tagged per lane (no prefix-cache hits across the lanes)
        assert p.messages[0][1].split("] ", 1)[1] == c.messages[0][1].split("] ", 1)[1]
        assert p.messages != c.messages and p.response_format is None and p.ignore_eos
        assert not c.ignore_eos and c.output_len == 2 * p.output_len
        fmt = json.loads(c.response_format)
        assert fmt["type"] == "json_schema"
        assert fmt["json_schema"]["schema"] == STRUCTURED_SCHEMA
    jsonschema.Draft202012Validator.check_schema(STRUCTURED_SCHEMA)
