"""vLLM's /tokenize and /detokenize on a real colocated gateway: the served tokenizer's ids
(text and chat template), token strings, a round trip, ids that generate what the text does,
and 400s naming the field."""

from __future__ import annotations

import httpx2 as httpx
import pytest

PROMPT = "The capital of France is"
CONV = [{"role": "user", "content": "What is the capital of France?"}]


def post(gateway, path: str, body) -> httpx.Response:
    return httpx.post(f"{gateway.http_url}/{path}", json=body, timeout=30)


def test_tokenize_text_and_chat_like_the_offline_tokenizer(gateway, offline):
    tok = offline.tokenizer
    r = post(gateway, "tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 8192
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    plain = post(gateway, "tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    assert plain["token_strs"] is None
    chat = post(gateway, "tokenize", {"messages": CONV}).json()
    assert chat["tokens"] == tok.apply_chat_template(CONV)
    no_gen = post(gateway, "tokenize", {"messages": CONV, "add_generation_prompt": False})
    assert no_gen.json()["tokens"] == tok.apply_chat_template(CONV, add_generation_prompt=False)
    assert no_gen.json()["count"] < chat["count"]


def test_detokenize_round_trip_and_generation_from_ids(gateway):
    ids = post(gateway, "tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert post(gateway, "detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}
    by_text = httpx.post(f"{gateway.http_url}/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 6, "temperature": 0}, timeout=60).json()
    by_ids = httpx.post(f"{gateway.http_url}/v1/completions", json={
        "prompt": ids, "max_tokens": 6, "temperature": 0}, timeout=60).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


BAD = [  # (case, path, body, param, bound named in the message)
    ("prompt not a string", "tokenize", {"prompt": 5}, "prompt", "string"),
    ("add_special_tokens not a boolean", "tokenize", {"prompt": "hi", "add_special_tokens": 1},
     "add_special_tokens", "boolean"),
    ("unknown role", "tokenize", {"messages": [{"role": "x", "content": "hi"}]},
     "messages[0].role", "user"),
    ("tokens not a list", "detokenize", {"tokens": "abc"}, "tokens", "list"),
    ("token outside the vocabulary", "detokenize", {"tokens": [1, 49152]}, "tokens[1]",
     "[0, 49152)"),
    ("body not an object", "detokenize", [1, 2], "body", "object"),
]


@pytest.mark.parametrize(("case", "path", "body", "param", "bound"), BAD,
                         ids=[c[0] for c in BAD])
def test_bad_tokenize_input_is_http_400(gateway, case, path, body, param, bound):
    resp = post(gateway, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and bound in err["message"], err
    assert post(gateway, "tokenize", {"prompt": "hi"}).status_code == 200


def test_tokenizer_info(gateway, offline):
    info = httpx.get(f"{gateway.http_url}/tokenizer_info", timeout=30).json()
    hf = offline.tokenizer.hf
    assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["chat_template"] == hf.chat_template and info["model_max_length"] == 8192
