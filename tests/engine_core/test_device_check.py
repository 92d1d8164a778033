"""PDSERVE_CHECK_DEVICE: the check itself (on the meta device, where a host tensor is
misplaced), and the engine's every step path under it, on the CPU and (marked gpu) on CUDA,
with the same output as without it: sampling, speculation, structured outputs, and the forks
of n samples (their shared last prompt block copied on write)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine_core.llm import LLM
from engine_core.platforms.device_check import ENV, DeviceCheck, DeviceMisplaced
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import StructuredOutput
from tests.tiny_model import words, write_tiny_llama

PROMPTS = [[5, 9, 200, 31, 5, 9, 200, 31, 5, 9], list(range(3, 60))]


def test_an_op_on_a_host_tensor_is_caught_and_explicit_moves_pass():
    host = torch.arange(6.0)
    with DeviceCheck("meta"):
        on = host.to("meta")  # an explicit move passes
        assert on.device.type == "meta" and host.shape == (6,) and host.tolist()
        (on * torch.tensor(2.0)).sum()  # a zero-dim host tensor is a scalar
        with pytest.raises(DeviceMisplaced, match=r"reads a \(6,\) torch.float32 tensor on cpu"):
            host + 1
        with pytest.raises(DeviceMisplaced):
            on[torch.tensor([0, 2])]  # indexing device memory with host indices
        with pytest.raises(DeviceMisplaced):
            host[:3]  # a view of unpinned host memory (pinned: staging, tests/gpu)
    check = DeviceCheck("meta")
    with check:
        assert check.exempt(lambda: (host + 1).sum())() == 21  # the KV connector's staging
        with pytest.raises(DeviceMisplaced):
            host + 1  # and checked again after it
    host + 1  # outside the mode: nothing checked


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def every_path(folder, device: str) -> list[tuple]:
    """Greedy, sampled with every filter and penalty, logit_bias, prompt logprobs, and
    ngram speculation: each step path of the engine once."""
    llm = LLM(model=str(folder), device=device, kv_cache_memory_gb=0.05,  # the defaults
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2,
                       prompt_logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, min_p=0.01,
                       repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                       logit_bias={7: 5.0}, seed=3, ignore_eos=True),
    ]
    outs = llm.generate([words(p) for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, len(o.prompt_logprobs or ())) for o in outs]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_step_path_runs_under_the_check_with_the_same_output(tiny, device, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    plain = every_path(tiny, device)
    monkeypatch.setenv(ENV, "1")
    checked = every_path(tiny, device)
    assert checked == plain
    assert plain[0][1] == len(PROMPTS[0]) and len(plain[1][0]) == 12


SCHEMA = {"type": "object", "properties": {"b": {"enum": ["x", "yy"]}, "c": {"type": "boolean"},
                                           "tags": {"type": "array", "maxItems": 2,
                                                    "items": {"enum": ["a", "b"]}}},
          "required": ["b", "c", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-bytes"), byte_level=True)


def grammar_and_forks(folder, device: str) -> list[tuple]:
    """A JSON schema, greedy and sampled, and three samples of one prompt as forks of one
    request: the children share its prompt blocks, the last (partial) one copied on write."""
    llm = LLM(model=str(folder), device=device, kv_cache_memory_gb=0.05)
    eng = llm.engine
    structured = StructuredOutput("json", json.dumps(SCHEMA))
    for i, temperature in enumerate((0.0, 1.0)):
        eng.add_request("the quick brown fox", SamplingParams(
            max_tokens=48, temperature=temperature, seed=5, structured=structured),
            req_id=f"json{i}")
    prompt = list(range(3, 24))  # 21 tokens: a partial last block of 16
    for i in range(3):
        eng.add_request(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i,
                                               ignore_eos=True),
                        req_id=f"n{i}", fork_of="n0" if i else None)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].text)
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks  # every reserved block freed
    return [outs[k] for k in sorted(outs)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grammars_and_forks_run_under_the_check_with_the_same_output(tiny_bytes, device,
                                                                     monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    plain = grammar_and_forks(tiny_bytes, device)
    monkeypatch.setenv(ENV, "1")
    assert grammar_and_forks(tiny_bytes, device) == plain
    for _, text in plain[:2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    samples = [tuple(ids) for ids, _ in plain[2:]]
    assert len(samples) == 3 and all(len(s) == 10 for s in samples)
    assert len(set(samples)) > 1  # each child drew with its own seed
