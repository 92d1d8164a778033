"""Tokenizers load through the class their config names, as AutoTokenizer would pick it, and
the gateway's model reading (tokenizer, config) never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from engine_core.model_files import resolve_model
from engine_core.tokenizer import load_tokenizer, pretrained_tokenizer
from tests.helpers import ROOT
from tests.tiny_model import write_tiny_llama

TEXTS = ["Hello world", "  two  spaces\tand a tab\n", "caf\u00e9 \u2603 \U0001f600", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def assert_same_tokenizer(ours, auto) -> None:
    assert type(ours) is type(auto)
    assert len(ours) == len(auto)
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.eos_token_id == auto.eos_token_id
    assert ours.chat_template == auto.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.decode(ids) == auto.decode(ids)
    if auto.chat_template:
        assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
                == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("byte_level", [False, True])
def test_a_saved_tiny_tokenizer_loads_as_auto_tokenizer_does(tmp_path, byte_level):
    write_tiny_llama(tmp_path, byte_level=byte_level)
    assert_same_tokenizer(pretrained_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path))


def test_the_default_models_tokenizer_loads_as_auto_tokenizer_does(model_path):
    load_tokenizer(resolve_model(model_path))  # builds the cached tokenizer.json once
    cache = next((model_path.parents[1] / "tokenizers").glob(f"{model_path.stem}-*"))
    assert_same_tokenizer(pretrained_tokenizer(cache), AutoTokenizer.from_pretrained(cache))


def test_a_config_naming_no_fast_class_goes_through_auto_tokenizer(tmp_path):
    write_tiny_llama(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    assert_same_tokenizer(pretrained_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path))


def test_the_gateway_starts_without_torch(model_path):
    """A gateway's start (gateway/server.py): its modules, the tokenizer and the model's config
    (disaggregated_backend_factory), and the disaggregated backend's own modules, in a process
    where torch cannot be imported."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pdserve.cli import build_parser\n"
        "from gateway.server import disaggregated_backend_factory\n"
        "import gateway.disagg.backend, gateway.disagg.worker_pools, gateway.disagg.canary\n"
        "from engine_core.model_files import resolve_model\n"
        "from engine_core.tokenizer import load_tokenizer\n"
        "from engine_core.weights.gguf_file import GGUFMetadata\n"
        f"args = build_parser().parse_args(['gateway', '--model', {str(model_path)!r},\n"
        "    '--prefill', '127.0.0.1:1', '--decode', '127.0.0.1:2'])\n"
        "disaggregated_backend_factory(args)\n"
        "source = resolve_model(args.model)\n"
        "config = GGUFMetadata(source.path).model_config()\n"
        "tok = load_tokenizer(source, config.eos_token_ids)\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "print(config.vocab_size, len(ids) > 0, tok.decode(ids[-3:]) != '')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["49152", "True", "True"]
