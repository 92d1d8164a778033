"""A chat answer's reasoning apart from its content, as vLLM's reasoning parsers and DeepSeek's
API return it: `message.reasoning_content` beside `message.content`, and streamed as
`delta.reasoning_content` deltas before the content's.

Parser "think": the model writes its reasoning between <think> and </think> (Qwen3, the
DeepSeek-R1 distills, SmolLM3 in thinking mode, QwQ):

    output                           reasoning_content   content
    <think>R</think>\\n\\nC             R                   C
    R</think>C   (the prompt ends     R                   C
                  with <think>)
    <think>R     (cut by max_tokens)  R                   null
    C            (no <think> first)   null                C

Leading whitespace before the first tag and after </think> is dropped. Parser "seed_oss"
splits ByteDance Seed-OSS's <seed:think> ... </seed:think> the same way (vLLM's seed_oss). A
structured output of such a chat starts after </think> (grammar_after_reasoning); a GPT-OSS
chat's response format after its final channel's header (grammar_after_analysis). `pdserve
gateway --reasoning-parser` picks it: auto (the default) uses "think" where the chat template
writes <think> (a thinking model's template does), "seed_oss" where it writes <seed:think>
and "harmony" (GPT-OSS's channels: gateway/openai/harmony.py) where it writes <|channel|>; none
leaves every output whole. Only chat
completions are split (gateway/openai/chat_output.py).
"""

from __future__ import annotations

import dataclasses

from engine_core.structured_output import MAX_AFTER_TOKENS, StructuredOutput
from gateway.openai.harmony import CHANNEL, MESSAGE

OPEN, CLOSE = "<think>", "</think>"
# the tag pair of each parser that splits at tags: ByteDance's Seed-OSS writes its own
TAGS = {"think": (OPEN, CLOSE), "seed_oss": ("<seed:think>", "</seed:think>")}
FINAL_HEADER = CHANNEL + "final" + MESSAGE  # harmony's final channel, whose text is the answer
# prompt tokens whose text tells whether the generation prompt opened or closed thinking
PROMPT_TAIL = 8
PARSERS = ("auto", "think", "seed_oss", "harmony", "none")


def resolve_parser(setting: str, chat_template: str | None) -> str | None:
    """The parser a server uses: "think", "harmony" (GPT-OSS: gateway/openai/harmony.py) or None."""
    if setting not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got "
                         f"{setting!r}")
    if setting == "auto":
        if chat_template and "<|channel|>" in chat_template:
            return "harmony"
        if chat_template and TAGS["seed_oss"][0] in chat_template:
            return "seed_oss"
        return "think" if chat_template and OPEN in chat_template else None
    return None if setting == "none" else setting


def grammar_after_reasoning(tokenizer, prompt_tail: str, so: StructuredOutput,
                            close_tag: str = CLOSE) -> StructuredOutput:
    """A structured output of a thinking chat, started after </think> (as vLLM does with a
    reasoning parser): the model reasons freely, the answer is constrained. Only where
    </think> is one token, and not when the prompt already closed the block (Qwen3's
    enable_thinking false); else the grammar holds from the first token, as before.
    prompt_tail: the text of the prompt's last PROMPT_TAIL tokens, special ones kept."""
    close = tokenizer.encode(close_tag, add_special_tokens=False)
    if len(close) != 1 or close_tag in prompt_tail:
        return so
    return dataclasses.replace(so, after_tokens=(close[0],))


def grammar_after_analysis(tokenizer, ids: list[int],
                           so: StructuredOutput) -> StructuredOutput:
    """A response format of a GPT-OSS chat, held to its final channel's text: the grammar
    starts after the header <|channel|>final<|message|> (where vLLM's GPT-OSS reasoning
    parser ends the reasoning), the analysis before it free. Only where <|channel|> and
    <|message|> are special tokens (GPT-OSS's tokenizer), and not when the prompt already
    opened the final channel (`ids`, the prompt, ends with the header); else the grammar holds
    from the first token."""
    header = tokenizer.encode(FINAL_HEADER, add_special_tokens=False)
    singles = all(len(tokenizer.encode(t, add_special_tokens=False)) == 1
                  for t in (CHANNEL, MESSAGE))
    if not singles or ids[-len(header):] == header or len(header) > MAX_AFTER_TOKENS:
        return so
    return dataclasses.replace(so, after_tokens=tuple(header))


def opens_reasoning(prompt_text: str, open_tag: str = OPEN) -> bool:
    """Whether a rendered prompt leaves the model inside <think> (DeepSeek-R1's template and
    Qwen3's thinking-only ones end the generation prompt with it)."""
    return prompt_text.rstrip().endswith(open_tag)


def chat_prompt(tokenizer, parser: str | None, ids: list[int], so: StructuredOutput | None,
                from_tools: bool) -> tuple[bool, StructuredOutput | None]:
    """For a chat whose prompt is `ids`, under the server's reasoning `parser`: (whether the
    prompt left the model inside <think>, its structured output started after the reasoning
    where it can be). `from_tools`: the constraint is a required or named tool's, which a
    harmony chat keeps over its whole output (its calls are the grammar's text, not
    commentary-channel messages)."""
    if parser == "harmony":
        return False, so if so is None or from_tools else grammar_after_analysis(tokenizer,
                                                                                 ids, so)
    if parser not in TAGS:
        return False, so
    open_tag, close_tag = TAGS[parser]
    tail = tokenizer.decode(ids[-PROMPT_TAIL:], skip_special_tokens=False)
    return opens_reasoning(tail, open_tag), None if so is None else grammar_after_reasoning(
        tokenizer, tail, so, close_tag)


class ReasoningSplit:
    """One choice's output text as it streams: `feed` each delta, then `finish`; each returns
    (reasoning delta, content delta), "" where there is none. Text that may be the start of a
    tag is held back until the next delta tells."""

    def __init__(self, in_reasoning: bool = False, tags: tuple[str, str] = (OPEN, CLOSE)
                 ) -> None:
        self.open_tag, self.close_tag = tags
        # "start": before the first non-space text; "reasoning"; "content"
        self.state = "reasoning" if in_reasoning else "start"
        self.held = ""
        self.saw_reasoning = in_reasoning
        self._strip_content = in_reasoning  # whitespace after </think> is dropped

    def feed(self, delta: str) -> tuple[str, str]:
        text, self.held = self.held + delta, ""
        reasoning = ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(self.open_tag):
                self.state, self.saw_reasoning = "reasoning", True
                text = stripped[len(self.open_tag):]
            elif self.open_tag.startswith(stripped):  # nothing yet, or part of the tag
                self.held = text
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = text.find(self.close_tag)
            if end < 0:
                keep = _partial_suffix(text, self.close_tag)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(self.close_tag):]
            self.state, self._strip_content = "content", True
        if self._strip_content:
            text = text.lstrip()
            self._strip_content = not text
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What is held back, as the text it turned out to be."""
        text, self.held = self.held, ""
        if self.state == "reasoning":
            return text, ""
        return "", text.lstrip() if self._strip_content else text


def split(text: str, in_reasoning: bool = False, tags: tuple[str, str] = (OPEN, CLOSE)
          ) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output; None where there is none."""
    parts = ReasoningSplit(in_reasoning, tags)
    reasoning, content = parts.feed(text)
    more_reasoning, more_content = parts.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    if not parts.saw_reasoning:
        return None, content
    return reasoning, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
