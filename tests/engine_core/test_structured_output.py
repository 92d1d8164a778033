"""Structured outputs in the colocated engine, on the real default model: every output of 23
JSON schemas validates (greedy and at temperature 1, all in one batch), regex / choice /
grammar constraints hold, a cut output finishes with `length`, grammars compile once, and the
sampler's mask stage bans exactly the disallowed tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from engine_core.sampler import Sampler
from engine_core.sampling_batch import SamplingBatch
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import StructuredOutput, fill_token_masks
from tests.native_kernels import native_sampling
from tests.structured_schemas import MAX_TOKENS, SCHEMAS, prompt_for


@pytest.fixture(scope="module")
def llm(offline):
    return offline.llm


def _chat_ids(llm, messages):
    return llm.tokenizer.apply_chat_template(messages)


def test_every_schema_validates_greedy_and_sampled_in_one_batch(llm):
    prompts, params, names = [], [], []
    for temperature in (0.0, 1.0):
        for name, schema in SCHEMAS.items():
            prompts.append(_chat_ids(llm, prompt_for(name, schema)))
            params.append(SamplingParams(
                max_tokens=MAX_TOKENS, temperature=temperature, seed=11,
                structured=StructuredOutput("json", json.dumps(schema))))
            names.append((name, temperature))
    assert len(SCHEMAS) >= 20
    outputs = llm.generate(prompts, params)
    for (name, temperature), out in zip(names, outputs, strict=True):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (name, temperature, o.text)
        try:
            value = json.loads(o.text)
        except ValueError as e:
            raise AssertionError(f"{name} at T={temperature}: not JSON: {o.text!r}") from e
        jsonschema.validate(value, SCHEMAS[name])
    # the grammar really shaped the output: unconstrained, the model writes prose
    free = llm.generate(prompts[0], SamplingParams(max_tokens=30, temperature=0.0))[0]
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(free.outputs[0].text), SCHEMAS[names[0][0]])
    assert llm.engine.runner.mask_timer.num_steps > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_regex_choice_and_grammar(llm):
    prompt = _chat_ids(llm, [{"role": "user", "content": "Give me a code."}])
    cases = [
        (StructuredOutput("regex", r"[A-Z]{2}-[0-9]{3}"), r"[A-Z]{2}-[0-9]{3}"),
        (StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"])),
         r"alpha|beta|gamma"),
        (StructuredOutput("grammar", 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'),
         r"x=[0-9]{1,3};"),
        (StructuredOutput("grammar", 'root ::= "ok" | "no"'), r"ok|no"),  # GBNF
    ]
    for temperature in (0.0, 1.0):
        outs = llm.generate([prompt] * len(cases), [
            SamplingParams(max_tokens=20, temperature=temperature, structured=so)
            for so, _ in cases])
        for (so, pattern), out in zip(cases, outs, strict=True):
            assert re.fullmatch(pattern, out.outputs[0].text), (so, out.outputs[0].text)
            assert out.outputs[0].finish_reason == "stop"


def test_json_object_and_a_cut_output_reports_length(llm):
    prompt = _chat_ids(llm, [{"role": "user", "content": "Describe a cat in JSON."}])
    out = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                              structured=StructuredOutput("json_object")))[0]
    o = out.outputs[0]
    assert o.text.startswith("{")
    # any object: the small model may write one longer than max_tokens (then it is cut)
    if o.finish_reason == "stop":
        assert isinstance(json.loads(o.text), dict)
    else:
        assert o.finish_reason == "length" and len(o.token_ids) == 40
    schema = SCHEMAS["product"]
    cut = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, structured=(
        StructuredOutput("json", json.dumps(schema)))))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    assert cut.text.startswith('{"name"')  # a valid prefix, and necessarily not a whole value
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_grammars_compile_once_and_bad_ones_raise(llm):
    compiler = llm.engine.grammar_compiler
    so = StructuredOutput("json", json.dumps(SCHEMAS["person"]))
    compiler.matcher(so)
    before = compiler.num_compiled
    compiler.matcher(StructuredOutput("json", json.dumps(SCHEMAS["person"])))
    assert compiler.num_compiled == before
    for bad in (StructuredOutput("regex", "(unclosed"), StructuredOutput("json", "{nope"),
                StructuredOutput("grammar", "start: undefined_rule"),
                StructuredOutput("choice", "[]")):
        with pytest.raises(ValueError):
            llm.engine.add_request("hi", SamplingParams(structured=bad))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml", "<a/>")


def test_sampler_masks_exactly_the_disallowed_tokens(llm):
    """Through the sampler's C-kernel path (temperature 1) and the greedy path: a row whose
    mask allows three tokens only ever draws those, an unconstrained row is untouched."""
    compiler = llm.engine.grammar_compiler
    matcher = compiler.matcher(StructuredOutput("choice", json.dumps(["a", "b", "c"])))
    vocab = llm.engine.model_config.vocab_size
    masks = fill_token_masks([matcher], vocab)
    allowed = {t for t in range(vocab) if masks[0, t // 32] >> (t % 32) & 1}
    assert allowed == {llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "abc"}
    logits = torch.randn(2, vocab)
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature)] * 2
        for seed in range(20):
            batch = SamplingBatch.from_requests(
                params, [[1]] * 2, [[]] * 2, [torch.Generator().manual_seed(seed)] * 2, vocab,
                eos_token_ids=(), token_masks=([0], masks))
            out = Sampler(native_sampling())(logits.clone(), batch).sampled_token_ids.tolist()
            assert out[0] in allowed
            if temperature == 0.0:
                assert out[1] == int(logits[1].argmax())
    assert np.count_nonzero(masks) >= 1


RECORDS = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "role"],
    "properties": {"name": {"enum": ["Ann", "Bob", "Cid"]},
                   "role": {"enum": ["dev", "ops"]}}}}


def test_draft_masks_walk_the_drafts(llm):
    from engine_core.structured_output import fill_draft_masks

    compiler = llm.engine.grammar_compiler
    matcher = compiler.matcher(StructuredOutput("choice", json.dumps(["ab", "cd"])))
    vocab = llm.engine.model_config.vocab_size
    enc = llm.tokenizer.encode
    a, c = enc("a", add_special_tokens=False)[0], enc("c", add_special_tokens=False)[0]
    b = enc("b", add_special_tokens=False)[0]
    masks = fill_draft_masks([matcher], [[a, c]], 3, vocab)[0]  # "a", then "c" is refused

    def allowed(row):
        return {t for t in range(vocab) if row[t // 32] >> (t % 32) & 1}

    assert {a, c} <= allowed(masks[0]) and b not in allowed(masks[0])
    assert b in allowed(masks[1]) and c not in allowed(masks[1])
    assert len(allowed(masks[2])) == vocab  # past the refused draft: never used
    assert matcher.consume_token(a) and matcher.consume_token(b)  # rolled back to the start


def test_speculative_drafts_are_checked_against_the_grammar(model_path):
    """n-gram drafts of constrained requests are verified under the grammar's masks: drafts
    are proposed and accepted, and every output still validates."""
    from engine_core.llm import LLM

    spec = LLM(str(model_path), kv_cache_memory_gb=0.1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompt = spec.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List four team members as JSON."}])
    params = [SamplingParams(max_tokens=120, temperature=t, seed=1, structured=(
        StructuredOutput("json", json.dumps(RECORDS)))) for t in (0.0, 0.0, 1.0, 1.0)]
    outs = spec.generate([prompt] * 4, params)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), RECORDS)
    stats = spec.engine.spec.stats
    assert stats.num_steps > 0 and sum(stats.num_accepted) > 0


def _run(llm, prompt, params, **kw):
    """One request's finished output (LLM._run collects it)."""
    return llm._run([llm.engine.add_request(prompt, params, **kw)], False)[0].outputs[0]


def test_a_grammar_that_starts_after_a_run_of_tokens(llm):
    """StructuredOutput.after_tokens (a reasoning model's </think>, GPT-OSS's final-channel
    header): the output is free up to the end of that run, as the unconstrained one, then held
    to the grammar; its first token alone starts nothing; a continuation whose earlier output
    holds the run starts under the grammar; a run that never comes leaves the output free; a
    grammar started among dropped tokens waits for its run again."""
    engine = llm.engine
    prompt = _chat_ids(llm, [{"role": "user", "content": "What is the capital of France?"}])
    free = _run(llm, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    for start, n in ((2, 1), (1, 3)):  # a run of one token, and of three
        run, head = free.token_ids[start:start + n], free.token_ids[:start + n]
        assert all(free.token_ids[i:i + n] != run for i in range(start))  # its first time
        digits = StructuredOutput("regex", r"[0-9]{3}", after_tokens=tuple(run))
        out = _run(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                  structured=digits))
        assert out.token_ids[:len(head)] == head and out.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{3}", llm.tokenizer.decode(out.token_ids[len(head):]))
        # a continuation: its prompt ends with the earlier attempt's output, the run among it
        cont = _run(llm, prompt + head, SamplingParams(max_tokens=20, temperature=0.0,
                                                          structured=digits),
                    num_prior_output_tokens=len(head))
        assert re.fullmatch(r"[0-9]{3}", cont.text)
    # a run whose first token comes, but not the rest after it
    (first, *_), never_after = free.token_ids[1:], llm.tokenizer.vocab_size - 1
    for never in ((never_after,), (first, never_after)):
        so = StructuredOutput("regex", r"[0-9]{3}", after_tokens=never)
        assert _run(llm, prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                   structured=so)).token_ids == free.token_ids
    with pytest.raises(ValueError, match="after_tokens must be in"):
        engine.add_request(prompt, SamplingParams(structured=StructuredOutput(
            "regex", "a", after_tokens=(3, 10**7))))
    from engine_core.request import Request

    run = tuple(free.token_ids[1:3])
    digits = StructuredOutput("regex", r"[0-9]{3}", after_tokens=run)
    head = free.token_ids[:3]
    req = Request("r", prompt, SamplingParams(max_tokens=20, structured=digits))
    assert req.start_grammar(engine.grammar_compiler.matcher(digits), run)
    req.append_output_token(head[0])
    req.num_computed_tokens = req.num_tokens - 1  # in its decode phase
    assert req.max_drafts(4) == 0  # waiting for its start: no unmasked drafts
    for t in (*head[1:], *llm.tokenizer.encode("12", add_special_tokens=False)):
        req.append_output_token(t)
    req.num_computed_tokens = req.num_tokens - 1
    assert req.matcher is not None and req.max_drafts(4) == 4
    req.truncate_output(len(head) - 1)  # the run's last token dropped: the grammar waits
    assert req.matcher is None
    req.append_output_token(run[-1])
    assert req.matcher.consume_tokens(llm.tokenizer.encode("123", add_special_tokens=False))
    assert req.matcher.is_accepting()


def test_structured_outputs_cross_the_wire_whole():
    """Every kind, with and without after_tokens, through the proto every hop sends."""
    from service_infra.proto_convert import structured_from_proto, structured_to_proto

    for after in ((), (0,), (200005, 17196, 200008)):
        for so in (StructuredOutput("json", '{"type": "object"}', after),
                   StructuredOutput("json_object", after_tokens=after),
                   StructuredOutput("regex", "[0-9]+", after),
                   StructuredOutput("choice", json.dumps(["a", "b"]), after),
                   StructuredOutput("grammar", 'start: "x"', after)):
            assert structured_from_proto(structured_to_proto(so)) == so
    for bad in ((-1,), [3], (True,), tuple(range(17))):
        with pytest.raises(ValueError, match="after_tokens must be a tuple of at most 16"):
            StructuredOutput("regex", "a", after_tokens=bad)
