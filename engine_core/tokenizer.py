"""Tokenizer, chat template and incremental detokenization, through transformers/tokenizers.

For a GGUF model, transformers builds a fast tokenizer from the file's BPE vocabulary and
merges (slow: ~10 s); we save it once as tokenizer.json under $PDSERVE_HOME and load that
afterwards. A saved fast tokenizer loads through the class its tokenizer_config.json names,
not AutoTokenizer: AutoTokenizer brings in transformers' model configurations and with them
torch (~3 s of every gateway start, and the gateway never needs torch).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine_core.model_files import ModelSource, pdserve_home

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class NoChatTemplateError(ValueError):
    """A chat request to a model with no chat template (and no --chat-template)."""


def read_chat_template(path: str | Path) -> str:
    """The Jinja chat template in `path` (--chat-template), checked to parse."""
    import jinja2

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--chat-template: {str(p)!r} is not a file")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"--chat-template: {str(p)!r} is empty")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: {str(p)!r} is not a valid Jinja template: "
                         f"line {e.lineno}: {e.message}") from None
    return text


class Tokenizer:
    """A thin, narrow face over a Hugging Face fast tokenizer.

    chat_template: a Jinja template that replaces the model's own (--chat-template); None
    keeps the model's, which a base model may lack."""

    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None) -> None:
        self.hf = hf
        self.chat_template = chat_template or hf.chat_template or None
        ids = list(eos_token_ids)
        if hf.eos_token_id is not None:
            ids.append(hf.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.vocab_size = len(hf)
        # detokenizing runs for every streamed token: call the Rust tokenizer directly when
        # transformers would add nothing to its output (~1 us against ~3 us through decode)
        backend = getattr(hf, "backend_tokenizer", None)
        self._backend = None if getattr(hf, "clean_up_tokenization_spaces", True) else backend

    def detokenizer(self, prompt_ids: Sequence[int],
                    skip_special_tokens: bool = True) -> StreamDetokenizer | IncrementalDetokenizer:
        """Turns one request's output tokens into text deltas (see the two classes)."""
        if self._backend is not None and _has_decode_stream():
            return StreamDetokenizer(self._backend, prompt_ids, skip_special_tokens)
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def template_renders_tools(self) -> bool:
        """Whether the chat template has a tool section: it writes a probe tool's name."""
        if not self.chat_template:
            return False
        probe = {"type": "function", "function": {
            "name": "pdserve_probe_tool", "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.hf.apply_chat_template([{"role": "user", "content": "hi"}],
                                               chat_template=self.chat_template,
                                               tools=[probe], tokenize=False,
                                               add_generation_prompt=True)
        except Exception:  # a template that refuses tools has no tool section either
            return False
        return "pdserve_probe_tool" in text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True,
        tools: list[dict] | None = None, template_kwargs: dict | None = None,
    ) -> list[int]:
        """`tools`: OpenAI's tool list, for a template with a tool section
        (`template_renders_tools`); messages may then carry tool_calls and tool results.
        `template_kwargs`: more variables for the template (vLLM's chat_template_kwargs:
        Qwen3's enable_thinking, GPT-OSS's reasoning_effort)."""
        if not self.chat_template:
            raise NoChatTemplateError(
                "this model has no chat template (a base model?); send a plain prompt to "
                "/v1/completions instead, or start the server with --chat-template FILE")
        text = self.hf.apply_chat_template(
            messages, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False,
            tools=tools or None, **(template_kwargs or {}),
        )
        # the template already wrote every special token it wants
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(source: ModelSource, eos_token_ids: Sequence[int] = (),
                   chat_template: str | None = None) -> Tokenizer:
    """The model's tokenizer; chat_template (a template's text) replaces the model's own."""
    if source.kind == "hf":
        return Tokenizer(pretrained_tokenizer(source.path), eos_token_ids, chat_template)
    stat = source.path.stat()
    cache = pdserve_home() / "tokenizers" / f"{source.path.stem}-{stat.st_size}"
    if (cache / "tokenizer.json").exists():
        return Tokenizer(pretrained_tokenizer(cache), eos_token_ids, chat_template)
    logger.info("building the tokenizer from %s (once; cached in %s)", source.path, cache)
    from transformers import AutoTokenizer

    from engine_core.weights.gguf_file import transformers_parses_plainly  # torch: only here

    with transformers_parses_plainly():
        hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + ".tmp")
    hf.save_pretrained(str(tmp))
    for f in Path(tmp).iterdir():
        f.replace(cache / f.name)
    Path(tmp).rmdir()
    return Tokenizer(hf, eos_token_ids, chat_template)


def pretrained_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `directory`. A fast one (tokenizer.json) whose
    tokenizer_config.json names its class loads through that transformers class, as
    AutoTokenizer would pick it; anything else goes through AutoTokenizer."""
    import transformers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if ((directory / "tokenizer.json").is_file() and isinstance(cls, type)
            and issubclass(cls, TokenizersBackend)):
        return cls.from_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


class StreamDetokenizer:
    """Text deltas of a growing list of token ids through `tokenizers`' own DecodeStream
    (Rust): the same text as IncrementalDetokenizer, one decode call per token instead of
    two, and an invalid byte sequence comes out as U+FFFD as in a whole decode."""

    def __init__(self, backend, prompt_ids: Sequence[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.stream = DecodeStream(ids=list(prompt_ids[-PROMPT_CONTEXT:]),
                                   skip_special_tokens=skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        if len(new_ids) == 1:
            return self.stream.step(self.backend, new_ids[0]) or ""
        return "".join(filter(None, (self.stream.step(self.backend, t) for t in new_ids)))


PROMPT_CONTEXT = 6  # prompt tokens before the output that a detokenizer decodes with it


@functools.cache
def _has_decode_stream() -> bool:
    """Whether this `tokenizers` has DecodeStream with a context of prior ids (0.22 on)."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)
    except (ImportError, TypeError):
        return False
    return True


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Invariant: `prefix_offset <= read_offset <= len(ids)`; text of ids[:read_offset] has been
    emitted. A few tokens before read_offset are re-decoded with the new ones so that byte-level
    BPE pieces and leading-space rules come out as in a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence (or nothing visible) so far
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
