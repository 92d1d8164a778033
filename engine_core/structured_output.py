"""Structured outputs: a request's grammar, compiled by llguidance into a token matcher.

    StructuredOutput   what the client asked for (kind + text), part of SamplingParams
    GrammarCompiler    StructuredOutput -> LLMatcher; one compile per distinct grammar (an LRU
                       cache of compiled matchers, each request gets a deep copy)
    fill_token_masks   one batched llguidance call: the allowed-token bitmask of every
                       constrained row of a step, [rows, ceil(V / 32)] int32, bit t % 32 of
                       word t // 32 set when token t is allowed

The matcher lives on the `Request`: it consumes every token appended to the output (the
prefill worker's first token included: the decode worker replays it on admission), so the
mask of the next step is always the mask of the request's current state.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import numpy as np

if TYPE_CHECKING:
    import torch

# kind -> how `StructuredOutput.spec` is read
KINDS = {
    "json": "a JSON schema (JSON text)",
    "json_object": "any JSON object (spec ignored)",
    "regex": "a regular expression (Rust regex syntax)",
    "choice": "a JSON list of strings, one of which is the output",
    "grammar": "a Lark or GBNF grammar",
}
MAX_SPEC_CHARS = 256 * 1024
# JSON is written compactly, with OpenAI's separators: no free whitespace, which a small
# model can otherwise fill with newlines until max_tokens cuts the value
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CACHED_GRAMMARS = 256
MAX_AFTER_TOKENS = 16  # the longest run of tokens a grammar may wait for


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output. `kind` is one of KINDS; `spec` its text. `after_tokens`:
    the grammar starts after the output first holds these tokens in a row (a reasoning
    model's </think>, GPT-OSS's final-channel header), the output before them free; empty:
    from the first token (Request holds the matcher back until then)."""

    kind: str
    spec: str = ""
    after_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {sorted(KINDS)}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {self.spec!r:.80}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output spec must be at most {MAX_SPEC_CHARS} "
                             f"characters, got {len(self.spec)}")
        if (not isinstance(self.after_tokens, tuple) or len(self.after_tokens) > MAX_AFTER_TOKENS
                or not all(type(t) is int and t >= 0 for t in self.after_tokens)):
            raise ValueError(f"structured output after_tokens must be a tuple of at most "
                             f"{MAX_AFTER_TOKENS} token ids >= 0, got {self.after_tokens!r:.80}")

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form); raises ValueError for a spec that does not
        parse (the grammar itself is checked by `check`)."""
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                     defaults=JSON_OPTIONS)
            if self.kind == "json":
                json.loads(self.spec)  # a clear error for text that is not JSON
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec,
                                                                     defaults=JSON_OPTIONS)
            if self.kind == "choice":
                choices = json.loads(self.spec)
                if (not isinstance(choices, list) or not choices
                        or not all(isinstance(c, str) for c in choices)):
                    raise ValueError(f"choice must be a non-empty list of strings, got "
                                     f"{self.spec:.100}")
                return llguidance.grammar_from("choice", self.spec)
            return llguidance.grammar_from("regex" if self.kind == "regex" else "grammar",
                                           self.spec)
        except ValueError:
            raise
        except Exception as e:  # the library's own error types for a bad spec
            raise ValueError(str(e)) from None

    def check(self, tokenizer: llguidance.LLTokenizer | None = None) -> None:
        """Raise ValueError with llguidance's message when the grammar is invalid."""
        error = llguidance.LLMatcher.validate_grammar(self.grammar(), tokenizer)
        if error:
            raise ValueError(error)


class GrammarCompiler:
    """Compiles StructuredOutputs into matchers for one tokenizer; thread-safe.

    Compiling is the expensive part (llguidance builds the lexer and parser tables, ~ms to
    ~1 s); a cached compiled matcher is deep-copied for each request (~us)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # one LLTokenizer per tokenizer: building it walks the whole vocabulary (~1 s)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `so`'s grammar; ValueError for a bad one."""
        so = dataclasses.replace(so, after_tokens=())  # one compile whatever starts it
        with self._lock:
            template = self._cache.get(so)
            if template is not None:
                self._cache.move_to_end(so)
                return template.deep_copy()
        template = llguidance.LLMatcher(self.ll_tokenizer, so.grammar(), log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        with self._lock:
            self._cache[so] = template
            self.num_compiled += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template.deep_copy()


_executor: llguidance.LLExecutor | None = None


def fill_token_masks(matchers: Sequence[llguidance.LLMatcher], vocab_size: int) -> np.ndarray:
    """[len(matchers), ceil(vocab_size / 32)] int32 allowed-token bitmasks, one llguidance
    call for the whole batch (it spreads rows over its own threads and drops the GIL)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    masks = np.zeros((len(matchers), (vocab_size + 31) // 32), dtype=np.int32)
    _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                      masks.ctypes.data, masks.shape[1] * 4, len(matchers))
    return masks


def fill_draft_masks(matchers: Sequence[llguidance.LLMatcher], drafts: Sequence[Sequence[int]],
                     num_positions: int, vocab_size: int) -> np.ndarray:
    """[len(matchers), num_positions, ceil(V / 32)] int32: row b's mask before its first
    draft, then after each of its drafts (llguidance walks the drafts and rolls the matcher
    back). Positions past a row's drafts, or past a draft the grammar refuses, allow every
    token: the verifier never takes a token there."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    width = (vocab_size + 31) // 32
    masks = np.full((len(matchers), num_positions, width), -1, dtype=np.int32)
    _executor.unsafe_compute_mask_ptr_with_draft_token(
        [(m, b * num_positions, list(d)) for b, (m, d) in enumerate(zip(matchers, drafts,
                                                                         strict=True))],
        masks.ctypes.data, width * 4, len(matchers) * num_positions)
    return masks


def unpack_masks(masks: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmasks -> [R, vocab_size] bool, True = allowed."""
    import torch  # the engine's side; the gateway validates grammars without torch

    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]
    return torch.from_numpy(bits[:, :vocab_size].astype(bool))


@dataclass
class MaskTimer:
    """Seconds the engine spent building token masks (for stats): total and per step."""

    num_steps: int = 0
    seconds: float = 0.0

    def timed_fill(self, matchers: Sequence[llguidance.LLMatcher], vocab_size: int) -> np.ndarray:
        t = time.perf_counter()
        masks = fill_token_masks(matchers, vocab_size)
        self.seconds += time.perf_counter() - t
        self.num_steps += 1
        return masks
