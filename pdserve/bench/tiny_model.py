"""A tiny random Llama (2 layers, hidden 128, a word-level vocabulary of 512), written by
transformers into a folder: a model whose compute is small, so that what a benchmark
measures on it is the host's cost around the model (`pdserve bench --workload
host-overhead`). The tests build the same model (tests/tiny_model.py).

Its tokenizer's tokens are "w0", "w1", ...: `words(ids)` is the text that encodes to `ids`.
"""

from __future__ import annotations

from pathlib import Path

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=1, initializer_range=0.08)
FIRST_WORD = 3  # ids 0, 1, 2 are <s>, </s>, <unk>


def words(ids) -> str:
    """The prompt text that the tiny tokenizer encodes to `ids` (each id >= FIRST_WORD)."""
    return " ".join(f"w{i}" for i in ids)


def word_tokenizer(vocab_size: int):
    """The tiny models' word-level tokenizer (transformers' fast tokenizer around it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """config.json, model.safetensors and the word-level tokenizer, in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    word_tokenizer(config.vocab_size).save_pretrained(folder)
    return folder


def bench_tiny_model() -> Path:
    """The benchmark's tiny model under $PDSERVE_HOME, written once."""
    from engine_core.model_files import pdserve_home

    folder = pdserve_home() / "models" / "bench-tiny-llama"
    if not (folder / "tokenizer.json").exists():  # written last
        folder.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(folder)
    return folder
