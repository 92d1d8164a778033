"""A model without a chat template (a base model, as Gemma 3 270M's GGUF is): chat requests
are refused with a 400 that says so, until `--chat-template FILE` gives one, which then
replaces whatever the model has. Real gateways over a tiny random model with no template."""

from __future__ import annotations

import httpx2 as httpx
import pytest

from engine_core.tokenizer import NoChatTemplateError, Tokenizer, read_chat_template
from tests.gateway.conftest import spawn_gateway, stop_gateway, wait_ready
from tests.tiny_model import write_tiny_llama

CONV = [{"role": "user", "content": "w7 w8"}, {"role": "assistant", "content": "w9"},
        {"role": "user", "content": "w10"}]
# words of the tiny tokenizer: a user turn is "w3 <content>", an assistant one "w4 <content>"
TEMPLATE = ("{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}")


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """(a gateway without a template, one with --chat-template), started together."""
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    procs = [spawn_gateway("--model", str(folder)),
             spawn_gateway("--model", str(folder), "--chat-template", str(template))]
    started = []
    try:
        for proc, log in procs:
            started.append(wait_ready(proc, log))
        yield started
    finally:
        for gw in started:
            stop_gateway(gw)
        for proc, _ in procs[len(started):]:
            proc.kill()
            proc.wait()


def chat(gw, **extra) -> httpx.Response:
    return httpx.post(f"{gw.http_url}/v1/chat/completions", timeout=60,
                      json={"messages": CONV, "max_tokens": 4, "temperature": 0, **extra})


def test_chat_to_a_model_without_a_template_is_400_naming_it(gateways):
    plain, _ = gateways
    resp = chat(plain)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "messages"
    assert "has no chat template" in err["message"] and "--chat-template" in err["message"]
    # a plain prompt still works
    ok = httpx.post(f"{plain.http_url}/v1/completions", timeout=60,
                    json={"prompt": "w7 w8", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_chat_template_file_is_applied(gateways):
    _, templated = gateways
    tokens = httpx.post(f"{templated.http_url}/tokenize", json={"messages": CONV},
                        timeout=30).json()["tokens"]
    assert tokens == [3, 7, 8, 4, 9, 3, 10, 4]  # w3 w7 w8 w4 w9 w3 w10 w4
    resp = chat(templated)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == len(tokens)
    info = httpx.get(f"{templated.http_url}/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == TEMPLATE


def test_tokenizer_template_override_and_bad_files(tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(write_tiny_llama(tmp_path / "tiny")))
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        Tokenizer(hf).apply_chat_template(CONV)
    assert Tokenizer(hf, chat_template=TEMPLATE).apply_chat_template(CONV) == [
        3, 7, 8, 4, 9, 3, 10, 4]
    with pytest.raises(ValueError, match="--chat-template: .* is not a file"):
        read_chat_template(tmp_path / "missing.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template: line 1"):
        read_chat_template(bad)
