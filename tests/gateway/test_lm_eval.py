"""lm-evaluation-harness (`lm-eval`) runs its `local-completions` model against the real
colocated gateway, with its "remote" tokenizer (our /tokenize, /detokenize and
/tokenizer_info), on two small local tasks written here (hub datasets are unreachable): a
loglikelihood (multiple choice) task and a generate_until task. Each item's result equals
what the offline engine computes for the same tokens."""

from __future__ import annotations

import json
import math

import pytest

from engine_core.sampling_params import SamplingParams

lm_eval = pytest.importorskip("lm_eval")

CAPITALS = [("France", ["Paris", "London", "Rome"], 0),
            ("Italy", ["Madrid", "Rome", "Berlin"], 1),
            ("Germany", ["Vienna", "Oslo", "Berlin"], 2)]
GEN_PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
MAX_GEN_TOKS = 6


def write_tasks(root) -> None:
    mc = root / "capitals.jsonl"
    mc.write_text("".join(json.dumps({"country": c, "choices": [f" {x}" for x in ch],
                                      "answer": a}) + "\n" for c, ch, a in CAPITALS))
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n"
                           for p in GEN_PROMPTS))
    (root / "pdserve_capitals.yaml").write_text(f"""task: pdserve_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (root / "pdserve_gen.yaml").write_text(f"""task: pdserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")


def test_lm_eval_local_completions_equals_offline_engine(gateway, offline, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "SmolLM2-135M-Instruct",
                    "base_url": f"{gateway.http_url}/v1/completions",
                    "tokenizer_backend": "remote", "tokenized_requests": True,
                    "num_concurrent": 1, "max_retries": 1, "timeout": 120},
        tasks=["pdserve_capitals", "pdserve_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, batch_size=4)
    tok = offline.tokenizer
    samples = results["samples"]["pdserve_capitals"]
    assert len(samples) == len(CAPITALS)
    num_checked = 0
    for sample in samples:
        for (context, continuation), (loglik, _) in zip(
                sample["arguments"], [r[0] for r in sample["resps"]], strict=True):
            num_checked += 1
            ctx = tok.encode(context, add_special_tokens=False)
            cont = tok.encode(continuation, add_special_tokens=False)
            out = offline.llm.generate(ctx + cont, SamplingParams(
                max_tokens=1, temperature=0, prompt_logprobs=0))[0]
            want = sum(out.prompt_logprobs[len(ctx) + j][t] for j, t in enumerate(cont))
            assert math.isclose(loglik, want, abs_tol=1e-3), (context, continuation)
    assert num_checked == sum(len(c) for _, c, _ in CAPITALS)
    assert "acc,none" in results["results"]["pdserve_capitals"]
    gen = results["samples"]["pdserve_gen"]
    assert len(gen) == len(GEN_PROMPTS)
    for sample in gen:
        prompt = sample["arguments"][0][0]
        ids = tok.encode(prompt, add_special_tokens=False)
        out = offline.llm.generate(ids, SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0,
                                                       stop=["\n"]))[0]
        assert sample["resps"][0][0] == out.outputs[0].text
    gateway.wait_idle()
