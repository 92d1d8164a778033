"""What the load generator sends: lists of `BenchRequest`, one list per lane.

| workload | prompt | output |
| --- | --- | --- |
| fixed | `input_len` tokens of English text, distinct per request | `output_len`, EOS ignored |
| random | lengths uniform in len * [1 - r, 1 + r] (r = `range_ratio`), like vLLM's random dataset | same |
| prompts | the shipped prompts (data/prompts.jsonl: questions, instructions, summaries...) as chat | up to `output_len`, natural end |
| shared-prefix | a `prefix_len`-token document shared by all + a distinct `input_len`-token suffix | `output_len`, EOS ignored |
| mixed | lane "decode": short prompts, long outputs; lane "long": 1-2k-token prompts, short outputs | EOS ignored |
| code-edit | the shipped snippets (data/code_edit.jsonl) with an edit instruction, as chat | the code's length + 48, natural end |
| structured | lane "json-schema": chats asking for a list of records, each with `response_format` json_schema (STRUCTURED_SCHEMA, ~150 tokens of JSON); lane "unconstrained": the same chats without it | json-schema: up to 2 x `output_len`, natural end (the schema ends it); unconstrained: `output_len`, EOS ignored |
| multi-turn | chats of 4-8 turns: an opener of 30-60 tokens (with `history_len`, a document of that many tokens before it: long agentic or RAG histories), then short follow-ups ("Why?"), each sent once the previous answer arrived, with that answer in its history | up to `output_len` per turn, natural end |

A multi-turn request carries its follow-ups (`follow_ups`): the runner sends the first turn, then
each follow-up as `next_turn(answer, follow_up)` of the turn before (group "first-turn", then
"follow-up": the turns whose history a decode worker may already hold).

Text prompts are cut from the shipped prompts' text (not random token ids, which decode to text
that does not encode back to the same tokens), so the same prompt goes out as token ids over
gRPC and as text over HTTP: `fit_tokens` makes `encode(text) == ids`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

from engine_core.tokenizer import Tokenizer
from pdserve.bench.args import WORKLOADS

# structured: six records of bounded fields; the JSON is ~150 tokens (the default output_len)
STRUCTURED_SCHEMA = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "city", "role"],
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 18, "maximum": 99},
                   "city": {"type": "string", "maxLength": 16},
                   "role": {"enum": ["engineer", "designer", "manager", "analyst"]}}}}
STRUCTURED_OUTPUT_LEN = 150
CODE_EDIT_EXTRA_TOKENS = 48  # room past the code's own length for the answer's wrapping
MAX_FIT_TRIES = 50
MIN_TURNS, MAX_TURNS = 4, 8  # multi-turn: turns per conversation
OPENERS = (
    "I am planning a long walk along the coast next spring, starting from a small fishing "
    "village and following the cliffs north for about a week. What should I pack?",
    "My sourdough bread keeps coming out dense and flat even though the starter bubbles "
    "nicely and I follow the recipe carefully. What could be going wrong with it?",
    "Explain how a refrigerator moves heat from its inside to the kitchen, as if I were a "
    "curious twelve-year-old who likes taking things apart.",
    "I have to give a five-minute talk to my team about why we should write tests before "
    "fixing bugs. Help me structure it so that it is short and convincing.",
    "What are the main differences between a lake and a reservoir, and why do engineers "
    "care about how quickly sediment fills a reservoir?",
    "Suggest a simple weekly plan for someone who wants to start running but has never "
    "run more than a kilometre without stopping.",
)
FOLLOW_UPS = ("Why?", "Give one more tip.", "Can you say that more briefly?", "And then?",
              "What is the most common mistake?", "Thanks. Anything else?",
              "Explain the second point.", "Give an example.")


@dataclass(frozen=True)
class BenchRequest:
    output_len: int  # max_tokens
    input_len: int  # prompt tokens as counted here (the server's usage overrides it)
    prompt_ids: tuple[int, ...] | None = None  # a plain prompt: ids over gRPC ...
    prompt_text: str | None = None  # ... and this text over HTTP
    messages: tuple[tuple[str, str], ...] | None = None  # a chat prompt: (role, content)
    ignore_eos: bool = True
    group: str = "main"
    # structured outputs: OpenAI's response_format object as JSON text (None: unconstrained)
    response_format: str | None = None
    follow_ups: tuple[str, ...] = ()  # multi-turn: the user's later turns, in order

    def next_turn(self, answer: str, follow_up: str) -> BenchRequest:
        """The chat's next request: this one's messages, the answer, then the follow-up; its
        prompt length is the server's to report (usage)."""
        if self.messages is None:
            raise ValueError("only a chat request has a next turn")
        return dataclasses.replace(
            self, input_len=0, messages=(*self.messages, ("assistant", answer),
                                         ("user", follow_up)),
            follow_ups=(), group="follow-up")


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "random"
    num_prompts: int = 32
    input_len: int = 128
    output_len: int | None = None  # None: the workload's default
    range_ratio: float = 0.5  # random: lengths in len * [1 - r, 1 + r]
    prefix_len: int = 256  # shared-prefix: tokens every prompt shares
    num_long: int = 4  # mixed: long prompts
    long_input_range: tuple[int, int] = (1024, 2048)
    long_output_len: int = 16
    ignore_eos: bool | None = None  # None: the workload's default (see the table above)
    seed: int = 0
    history_len: tuple[int, int] | None = None  # multi-turn: a document of lo-hi tokens first

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        for name in ("num_prompts", "input_len", "prefix_len", "long_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        lo, hi = self.long_input_range
        if not 1 <= lo <= hi:
            raise ValueError(f"long_input_range must be 1 <= low <= high, got {lo} {hi}")
        if self.num_long < 0:
            raise ValueError(f"num_long must be >= 0, got {self.num_long}")
        if self.history_len is not None and not 1 <= self.history_len[0] <= self.history_len[1]:
            raise ValueError(f"history_len must be 1 <= low <= high, got {self.history_len}")


def _data(name: str) -> list[dict]:
    text = resources.files("pdserve.bench").joinpath("data", name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@cache
def shipped_prompts() -> tuple[str, ...]:
    return tuple(row["prompt"] for row in _data("prompts.jsonl"))


@cache
def shipped_code_edits() -> tuple[str, ...]:
    """Each an instruction followed by the code in a fenced block."""
    return tuple(f"{row['instruction']}\n\n```{row['language']}\n{row['code']}```"
                 for row in _data("code_edit.jsonl"))


def fit_tokens(tokenizer: Tokenizer, ids: list[int], n: int) -> tuple[list[int], str] | None:
    """`n` token ids (from `ids`, which has a few spare at the end) and their text, such that
    encoding the text gives back exactly those ids; None if a few rounds of decode/encode do
    not find them (a cut through a word or a blank line may re-merge differently)."""
    target = list(ids[:n])
    for _ in range(4):
        text = tokenizer.decode(target, skip_special_tokens=False)
        again = tokenizer.encode(text, add_special_tokens=False)
        if again == target:
            return target, text
        target = again[:n] if len(again) >= n else again + list(ids[n:n + n - len(again)])
    return None


class _TextSource:
    """Distinct stretches of English text cut from the shipped prompts, token-exact."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.pool = tokenizer.encode("\n\n".join(shipped_prompts()), add_special_tokens=False)

    def ids(self, n: int, head: str = "") -> tuple[list[int], str]:
        """`head` (which makes prompts distinct from the first token) then pool text from a
        random place, wrapping around; n tokens in all."""
        head_ids = self.tokenizer.encode(head, add_special_tokens=False) if head else []
        if len(head_ids) >= n:  # too short for a head: pool text only
            head_ids = []
        for _ in range(MAX_FIT_TRIES):  # a few percent of cuts do not fit: another place does
            start = int(self.rng.integers(len(self.pool)))
            body = [self.pool[(start + i) % len(self.pool)] for i in range(n + 16)]
            fitted = fit_tokens(self.tokenizer, head_ids + body, n)
            if fitted is not None:
                return fitted
        raise RuntimeError(f"no {n}-token stretch of text that encodes back to itself was "
                           f"found in {MAX_FIT_TRIES} tries")


def _plain(src: _TextSource, n: int, out: int, head: str, ignore_eos: bool,
           group: str = "main", prefix: tuple[list[int], str] = ([], "")) -> BenchRequest:
    ids, text = src.ids(n, head)
    ids, text = prefix[0] + ids, prefix[1] + text
    return BenchRequest(out, len(ids), tuple(ids), text, ignore_eos=ignore_eos, group=group)


def _chat(tokenizer: Tokenizer, content: str, out: int, ignore_eos: bool,
          group: str = "main", follow_ups: tuple[str, ...] = ()) -> BenchRequest:
    n = len(tokenizer.apply_chat_template([{"role": "user", "content": content}]))
    return BenchRequest(out, n, messages=(("user", content),), ignore_eos=ignore_eos,
                        group=group, follow_ups=follow_ups)


def _conversation(tokenizer: Tokenizer, rng: np.random.Generator, i: int, out: int,
                  ignore_eos: bool, history: _TextSource | None = None,
                  history_len: tuple[int, int] | None = None) -> BenchRequest:
    """Chat i: a tagged opener (no two chats share more than the template's head), after a
    document of history_len tokens if given, and its 3-7 follow-ups."""
    opener = OPENERS[int(rng.integers(len(OPENERS)))]
    num_turns = int(rng.integers(MIN_TURNS, MAX_TURNS + 1))
    follow_ups = tuple(FOLLOW_UPS[int(j)] for j in rng.integers(len(FOLLOW_UPS),
                                                                size=num_turns - 1))
    content = f"(chat {i}) {opener}"
    if history is not None and history_len is not None:
        _, document = history.ids(int(rng.integers(history_len[0], history_len[1] + 1)),
                                  f"(chat {i}) Read this first.\n\n")
        content = f"{document}\n\n{opener}"
    return _chat(tokenizer, content, out, ignore_eos, "first-turn", follow_ups)


def build_workload(config: WorkloadConfig, tokenizer: Tokenizer) -> dict[str, list[BenchRequest]]:
    """The requests of each lane, in the order they are issued. Deterministic for a seed."""
    rng = np.random.default_rng(config.seed)
    src = _TextSource(tokenizer, rng)
    n, c = config.num_prompts, config
    natural = c.name in ("prompts", "code-edit", "multi-turn")
    eos = (not natural) if c.ignore_eos is None else c.ignore_eos
    out_len = c.output_len or {"prompts": 128, "code-edit": 128, "multi-turn": 32}.get(c.name, 64)
    if c.name == "fixed":
        return {"main": [_plain(src, c.input_len, out_len, f"Request {i}: ", eos)
                         for i in range(n)]}
    if c.name == "random":
        lo_in, hi_in = _bounds(c.input_len, c.range_ratio)
        lo_out, hi_out = _bounds(out_len, c.range_ratio)
        return {"main": [_plain(src, int(rng.integers(lo_in, hi_in + 1)),
                                int(rng.integers(lo_out, hi_out + 1)), f"Request {i}: ", eos)
                         for i in range(n)]}
    if c.name == "shared-prefix":
        # each suffix starts with a blank line, which the tokenizer never merges with the
        # document's last word: the document's tokens are the same in every prompt
        prefix = src.ids(c.prefix_len, "Read this document, then answer.\n\n")
        return {"main": [_plain(src, c.input_len, out_len, f"\n\nQuestion {i}: ", eos,
                                prefix=prefix) for i in range(n)]}
    if c.name == "mixed":
        decode = [_plain(src, c.input_len, out_len, f"Request {i}: ", eos, "decode")
                  for i in range(n)]
        lo, hi = c.long_input_range
        long = [_plain(src, int(rng.integers(lo, hi + 1)), c.long_output_len,
                       f"Document {i}: ", eos, "long") for i in range(c.num_long)]
        return {"decode": decode, "long": long}
    if c.name == "structured":
        return _structured(tokenizer, c, rng)
    if c.name == "multi-turn":
        return {"main": [_conversation(tokenizer, rng, i, out_len, eos, src, c.history_len)
                         for i in range(n)]}
    texts = shipped_prompts() if c.name == "prompts" else shipped_code_edits()
    order = rng.permutation(len(texts))
    reqs = []
    for i in range(n):
        text = texts[order[i % len(texts)]]
        out = out_len
        if c.name == "code-edit" and c.output_len is None:
            code = text.split("```", 1)[1]
            out = len(tokenizer.encode(code, add_special_tokens=False)) + CODE_EDIT_EXTRA_TOKENS
        reqs.append(_chat(tokenizer, text, out, eos))
    return {"main": reqs}


def _structured(tokenizer: Tokenizer, c: WorkloadConfig,
                rng: np.random.Generator) -> dict[str, list[BenchRequest]]:
    """The same chats twice: constrained by STRUCTURED_SCHEMA, and not (EOS ignored, so each
    unconstrained answer is about as long as a constrained one). Each lane's chats start with
    its own tag, so the lane that runs second finds no prompt in the prefix cache."""
    out = c.output_len or STRUCTURED_OUTPUT_LEN
    fmt = json.dumps({"type": "json_schema", "json_schema": {
        "name": "people", "schema": STRUCTURED_SCHEMA}})
    texts = shipped_prompts()
    order = rng.permutation(len(texts))

    def chat(i: int, lane: str) -> BenchRequest:
        text = texts[order[i % len(texts)]][:300]
        return _chat(tokenizer, f"[{lane} {i}] {text}\n\nNow list six people who could "
                     "help, as JSON records.", out, True)

    return {"unconstrained": [dataclasses.replace(chat(i, "u"), group="unconstrained")
                              for i in range(c.num_prompts)],
            "json-schema": [dataclasses.replace(chat(i, "j"), output_len=2 * out,
                                                ignore_eos=False, group="json-schema",
                                                response_format=fmt)
                            for i in range(c.num_prompts)]}


def _bounds(length: int, ratio: float) -> tuple[int, int]:
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
