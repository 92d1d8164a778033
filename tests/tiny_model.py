"""Tiny random Llama checkpoints, built by transformers inside the tests (no download).

`write_tiny_llama(folder)` saves config.json + model.safetensors and a word-level tokenizer
whose tokens are "w0", "w1", ... so that a prompt such as "w3 w17 w5" encodes to known ids.
With `byte_level=True` the tokenizer is a byte-level BPE instead, trained here on a few lines
of text and JSON: it can spell any text, which a grammar (structured outputs) needs.
The engine loads the folder as it loads any Hugging Face checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from pdserve.bench.tiny_model import TINY, word_tokenizer, words  # noqa: F401 (re-exported)

# SmolLM2-135M's shapes with random weights: for speed, where the weights' values don't matter.
SMOLLM2_SHAPE = dict(TINY, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rope_theta=100000.0, initializer_range=0.02)


BPE_CORPUS = ['{"name": "w", "value": 12, "ok": false, "tags": ["a", "b"]}',
              '{"b": "x", "c": true, "n": null}', "the quick brown fox jumps over the lazy dog"]


def write_tiny_llama(folder: Path, seed: int = 0, byte_level: bool = False,
                     config_cls=None, **overrides) -> Path:
    """config_cls: another transformers config class than Llama's (a tiny model of that
    architecture, with the same tokenizer)."""
    config = (config_cls or LlamaConfig)(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = (LlamaForCausalLM(config) if config_cls is None
             else AutoModelForCausalLM.from_config(config))
    model.save_pretrained(folder, safe_serialization=True)
    if byte_level:  # ids 0, 1, 2 are <s>, </s>, <unk> as below; fewer ids than the model has
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(BPE_CORPUS * 10, trainers.BpeTrainer(
            vocab_size=min(config.vocab_size, 400), special_tokens=["<s>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                       eos_token="</s>", unk_token="<unk>")
    else:
        fast = word_tokenizer(config.vocab_size)
    fast.save_pretrained(folder)
    return folder

