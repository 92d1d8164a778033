"""A chat answer's reasoning apart from its content (gateway/openai/reasoning.py): the split itself,
streamed in any pieces, against a plain reference; and through a real `pdserve gateway
--colocated` whose chat template writes <think> (so `auto` picks the think parser), with the
real model's output held to a thinking shape by a regex (structured outputs), the `openai`
client reading reasoning_content non-streamed and streamed, with tool calls parsed from the
content, and chat_template_kwargs reaching the template."""

from __future__ import annotations

import json
import re

import httpx2 as httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai.reasoning import CLOSE, OPEN, TAGS, ReasoningSplit, resolve_parser, split
from tests.gateway.conftest import openai_client

MODEL = "SmolLM2-135M-Instruct"


def reference(text: str, opened: bool, tags: tuple[str, str] = (OPEN, CLOSE)
              ) -> tuple[str | None, str | None]:
    """The split, written plainly: reasoning from an opening tag (or the prompt's) to the
    first closing one, the rest content; whitespace around the tags dropped."""
    open_tag, close_tag = tags
    if not opened:
        if not text.lstrip().startswith(open_tag):
            return None, text
        text = text.lstrip()[len(open_tag):]
    reasoning, closed, content = text.partition(close_tag)
    if not closed:
        return reasoning, None
    return reasoning, content.lstrip() or None


PIECES = [OPEN, CLOSE, *TAGS["seed_oss"], "<", "</", "think", ">", "seed:", "a", "b c", " ",
          "\n", "<thin", "k>"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.booleans(),
       st.sampled_from(sorted(TAGS.values())), st.data())
def test_streamed_split_equals_the_reference_whatever_the_pieces(pieces, opened, tags, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ReasoningSplit(opened, tags)
    parts = [stream.feed(d) for d in deltas] + [stream.finish()]
    reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
    want_reasoning, want_content = reference(text, opened, tags)
    assert split(text, opened, tags) == (want_reasoning, want_content)
    assert reasoning == (want_reasoning or "") and content == (want_content or "")


def test_the_documented_cases_and_the_parser_choice():
    assert split("<think>R</think>\n\nC") == ("R", "C")
    assert split("R</think>C", in_reasoning=True) == ("R", "C")
    assert split("<think>R") == ("R", None)
    assert split("  C <think>") == (None, "  C <think>")
    stream = ReasoningSplit()  # a tag split across deltas is held until it is whole
    assert [stream.feed(d) for d in ("<th", "ink>Let me", " see</th", "ink>Yes")] == [
        ("", ""), ("Let me", ""), (" see", ""), ("", "Yes")]
    assert resolve_parser("auto", "{{ '<think>' }}") == "think"
    assert resolve_parser("auto", "{{ messages }}") is None
    assert resolve_parser("auto", None) is None
    assert resolve_parser("none", "<think>") is None and resolve_parser("think", None) == "think"
    assert resolve_parser("auto", "<|start|>assistant<|channel|>final<think>") == "harmony"
    # ByteDance Seed-OSS's own tags (vLLM's seed_oss parser)
    assert resolve_parser("auto", "{{ '<seed:think>' }}") == "seed_oss"
    assert split("<seed:think>R</seed:think>\n\nC", tags=TAGS["seed_oss"]) == ("R", "C")
    assert split("<think>R</think>C", tags=TAGS["seed_oss"]) == (None, "<think>R</think>C")
    with pytest.raises(ValueError, match="auto, think, seed_oss, harmony, none"):
        resolve_parser("deepseek", None)


def test_a_thinking_chats_grammar_starts_after_its_reasoning():
    """With a tokenizer whose </think> is one token (as Qwen3's and DeepSeek-R1's are), a
    structured output starts after it, unless the prompt already closed the block; where it
    is several tokens (SmolLM2's), the grammar holds from the first token."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from engine_core.structured_output import StructuredOutput
    from engine_core.tokenizer import Tokenizer
    from gateway.openai.reasoning import grammar_after_reasoning

    words = ["<unk>", "hi", "assistant", "<", "/", "think", ">"]
    rust = RustTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    rust.pre_tokenizer = Whitespace()
    so = StructuredOutput("regex", "[0-9]+")
    for single in (True, False):
        hf = PreTrainedTokenizerFast(tokenizer_object=rust.__class__.from_str(rust.to_str()))
        if single:
            hf.add_tokens(["<think>", "</think>"])
        tok = Tokenizer(hf)
        close = tok.encode("</think>", add_special_tokens=False)
        assert (len(close) == 1) == single
        open_prompt = tok.encode("hi assistant", add_special_tokens=False)
        closed_prompt = tok.encode("hi assistant <think> </think>", add_special_tokens=False)
        after = grammar_after_reasoning(tok, tok.decode(open_prompt, False), so)
        assert after == (StructuredOutput("regex", "[0-9]+", (close[0],)) if single else so)
        assert grammar_after_reasoning(tok, tok.decode(closed_prompt, False), so) == so


def test_a_gpt_oss_response_format_starts_after_the_final_header():
    """With a tokenizer whose <|channel|> and <|message|> are special tokens (GPT-OSS's), a
    response format starts after <|channel|>final<|message|>: the analysis channel is free; a
    required tool's constraint holds the whole output; so does a prompt that opened the final
    channel, and a tokenizer that spells those markers in pieces (SmolLM2's)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from engine_core.structured_output import StructuredOutput
    from engine_core.tokenizer import Tokenizer
    from gateway.openai.reasoning import chat_prompt

    words = ["<unk>", "hi", "assistant", "final", "analysis", "<", "|", "channel", "message",
             ">"]
    rust = RustTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    rust.pre_tokenizer = Whitespace()
    so = StructuredOutput("json_object")
    for special in (True, False):
        hf = PreTrainedTokenizerFast(tokenizer_object=rust.__class__.from_str(rust.to_str()))
        if special:
            hf.add_special_tokens({"additional_special_tokens": [
                "<|start|>", "<|channel|>", "<|message|>", "<|end|>"]})
        tok = Tokenizer(hf)
        header = tok.encode("<|channel|>final<|message|>", add_special_tokens=False)
        assert (len(header) == 3) == special
        prompt = tok.encode("<|start|>hi<|end|><|start|>assistant", add_special_tokens=False)
        opened = tok.encode("<|start|>assistant<|channel|>final<|message|>",
                            add_special_tokens=False)
        assert chat_prompt(tok, "harmony", prompt, so, False) == (
            False, StructuredOutput("json_object", after_tokens=tuple(header)) if special
            else so)
        assert chat_prompt(tok, "harmony", prompt, so, True) == (False, so)
        assert chat_prompt(tok, "harmony", opened, so, False) == (False, so)
        assert chat_prompt(tok, "harmony", prompt, None, False) == (False, None)
        assert chat_prompt(tok, None, prompt, so, False) == (False, so)


THINKING = r"<think>[a-z ]{4,30}</think>\n\n[A-Z][a-z ]{4,30}\."


@pytest.fixture(scope="module")
def client(thinking_gateway):
    yield from openai_client(thinking_gateway)


def _chat(client, regex: str, stream: bool = False, **kw):
    return client.chat.completions.create(**{
        "model": MODEL, "messages": [{"role": "user", "content": "Is the sky blue? Think first."}],
        "max_tokens": 80, "temperature": 0.0, "stream": stream, **kw,
        "extra_body": {"structured_outputs": {"regex": regex}, **kw.get("extra_body", {})}})


def test_reasoning_content_apart_streamed_and_not(client, thinking_gateway):
    resp = _chat(client, THINKING, n=2, seed=1, temperature=1.0)
    for choice in resp.choices:
        whole = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", _raw(choice.message), re.DOTALL)
        assert whole is not None and choice.finish_reason == "stop"
        assert choice.message.reasoning_content == whole.group(1)
        assert choice.message.content == whole.group(2)
    reasoning, content = {0: "", 1: ""}, {0: "", 1: ""}
    for chunk in _chat(client, THINKING, stream=True, n=2, seed=1, temperature=1.0):
        for c in chunk.choices:
            assert not (getattr(c.delta, "reasoning_content", None) and c.delta.content)
            reasoning[c.index] += getattr(c.delta, "reasoning_content", None) or ""
            content[c.index] += c.delta.content or ""
    for choice in resp.choices:  # the same seeds: the same texts, split alike
        assert reasoning[choice.index] == choice.message.reasoning_content
        assert content[choice.index] == choice.message.content
    thinking_gateway.wait_idle()


def _whole_and_streamed(client, regex: str):
    """A greedy chat held to `regex`, its message checked against its streamed deltas
    (reasoning_content and content each join to the whole message's)."""
    resp = _chat(client, regex)
    message = resp.choices[0].message
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in _chat(client, regex, stream=True):
        for key in streamed:
            streamed[key] += getattr(chunk.choices[0].delta, key, None) or ""
    assert streamed == {"reasoning_content": message.reasoning_content,
                        "content": message.content}
    return resp


def _raw(message) -> str:
    return f"{OPEN}{message.reasoning_content}{CLOSE}\n\n{message.content}"


def test_seed_oss_tags_split_streamed_and_not(seed_gateway):
    """A template that writes <seed:think> (Seed-OSS's): auto picks the seed_oss parser, its
    tags split reasoning from content whole and streamed; <think> is content there."""
    open_tag, close_tag = (re.escape(t) for t in TAGS["seed_oss"])
    regex = open_tag + r"[a-z ]{4,20}" + close_tag + r"\n\n[A-Z][a-z ]{4,30}\."
    for c in openai_client(seed_gateway):
        message = _whole_and_streamed(c, regex).choices[0].message
        assert re.fullmatch(r"[a-z ]{4,20}", message.reasoning_content)
        assert re.fullmatch(r"[A-Z][a-z ]{4,30}\.", message.content)
        plain = _chat(c, r"<think>[a-z ]{4,20}</think> [A-Z][a-z ]{4,30}\.").choices[0].message
        assert plain.content.startswith("<think>")
        assert getattr(plain, "reasoning_content", None) is None
    seed_gateway.wait_idle()


def test_an_answer_without_thinking_is_all_content(client):
    resp = _chat(client, r"[A-Z][a-z ]{4,30}\.")
    message = resp.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert re.fullmatch(r"[A-Z][a-z ]{4,30}\.", message.content)


def test_a_prompt_that_opens_thinking_and_chat_template_kwargs(client, thinking_gateway):
    """open_thinking (a chat_template_kwargs variable) ends the prompt inside <think>: the
    output up to </think> is reasoning without an opening tag. enable_thinking false renders
    Qwen3's empty think block, seen through /tokenize. Bad kwargs are a 400 naming the field."""
    resp = _chat(client, r"[a-z ]{4,30}</think>\n\n[A-Z][a-z ]{4,30}\.",
                 extra_body={"chat_template_kwargs": {"open_thinking": True}})
    message = resp.choices[0].message
    assert re.fullmatch(r"[a-z ]{4,30}", message.reasoning_content)
    assert re.fullmatch(r"[A-Z][a-z ]{4,30}\.", message.content)
    url = thinking_gateway.http_url
    messages = [{"role": "user", "content": "hi"}]
    effort = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "reasoning_effort": "extreme"}, timeout=30)
    assert effort.status_code == 400 and effort.json()["error"]["param"] == "reasoning_effort"
    for kwargs, has_block in (({"enable_thinking": False}, True), ({}, False)):
        ids = httpx.post(f"{url}/tokenize", json={"messages": messages,
                                                  "chat_template_kwargs": kwargs},
                         timeout=30).json()["tokens"]
        text = httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        assert (f"{OPEN}\n\n{CLOSE}" in text) == has_block
    for bad, says in (([1], "chat_template_kwargs must be an object"),
                      ({"add_generation_prompt": False},
                       "chat_template_kwargs may not set add_generation_prompt")):
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "chat_template_kwargs": bad}, timeout=30)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"
    thinking_gateway.wait_idle()


def test_tool_calls_come_from_the_content_after_the_reasoning(client):
    tool = {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    regex = r"<think>[a-z ]{4,20}</think>\n\n" + re.escape(call)
    for stream in (False, True):
        resp = _chat(client, regex, stream=stream, tools=[tool], tool_choice="auto")
        if stream:
            chunks = list(resp)
            reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                                for c in chunks if c.choices)
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            name = "".join(t.function.name or "" for t in calls)
            arguments = "".join(t.function.arguments or "" for t in calls)
            finish = chunks[-1].choices[0].finish_reason
        else:
            message = resp.choices[0].message
            reasoning, name = message.reasoning_content, message.tool_calls[0].function.name
            arguments, finish = message.tool_calls[0].function.arguments, \
                resp.choices[0].finish_reason
        assert re.fullmatch(r"[a-z ]{4,20}", reasoning)
        assert (name, json.loads(arguments), finish) == (
            "get_weather", {"city": "Paris"}, "tool_calls")


# -- GPT-OSS's harmony channels (gateway/openai/harmony.py) ------------------------------------------
H_PIECES = ["<|channel|>analysis<|message|>", "<|channel|>final<|message|>",
            "<|channel|>commentary<|message|>",
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>",
            " to=functions.g<|channel|>commentary json<|message|>",
            "<|end|><|start|>assistant", "<|end|>", "<|call|>", "<|", "<|e", "a b", '{"x":1}',
            "\n", "<"]


def harmony_reference(text: str, tools: frozenset[str]):
    """The harmony parse, written plainly over the whole text, message by message: a header
    up to <|message|> (one cut short ends the output), a body up to an end token, then the
    next message after <|start|>assistant, or content."""
    if re.match(r"\s*(?:to=|<\|channel\|>)", text) is None:
        return None, text, []
    reasoning, content, calls = None, [], []
    rest = text
    while True:
        head, sep, rest = rest.partition("<|message|>")
        if not sep:
            break
        end = re.search(r"<\|(?:end|return|call)\|>", rest)
        body, rest = (rest, "") if end is None else (rest[:end.start()], rest[end.end():])
        to = re.search(r"to=functions\.([^\s<]+)", head)
        if to and to.group(1) in tools:
            calls.append((to.group(1), body))
        elif re.search(r"<\|channel\|>\s*analysis", head):
            reasoning = (reasoning or "") + body
        else:
            content.append(body)
        if not rest.startswith("<|start|>assistant"):
            content.append(rest)
            break
        rest = rest[len("<|start|>assistant"):]
    return reasoning, "".join(content) or None, calls


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(H_PIECES), max_size=10), st.data())
def test_harmony_streamed_equals_the_reference_whatever_the_pieces(pieces, data):
    from gateway.openai.harmony import HarmonyStream, parse

    text = "".join(pieces)
    tools = frozenset({"f"})
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = HarmonyStream(tools)
    parts = [stream.feed(d) for d in deltas] + [stream.finish()]
    reasoning, content, calls = parse(text, tools)
    assert "".join(p[0] for p in parts) == (reasoning or "")
    assert "".join(p[1] for p in parts) == (content or "")
    streamed: dict[int, list[str]] = {}
    for p in parts:
        for delta in p[2]:
            streamed.setdefault(delta["index"], []).append(delta["function"]["arguments"])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c["function"]["name"], "".join(streamed[i])) for i, c in enumerate(calls)]
    want_reasoning, want_content, want_calls = harmony_reference(text, tools)
    assert (reasoning, content) == (want_reasoning, want_content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want_calls


ANALYSIS = r"<\|channel\|>analysis<\|message\|>[a-z ]{4,20}<\|end\|><\|start\|>assistant"


@pytest.fixture(scope="module")
def harmony_client(harmony_gateway):
    yield from openai_client(harmony_gateway)


def test_harmony_channels_and_function_calls(harmony_client):
    """GPT-OSS's format through a real gateway: the analysis channel is reasoning_content,
    final the content, a commentary message to functions.get_weather a tool call; streamed
    deltas join to the non-streamed message; reasoning_effort reaches the template."""
    final = ANALYSIS + r"<\|channel\|>final<\|message\|>[A-Z][a-z ]{4,30}\."
    resp = _whole_and_streamed(harmony_client, final)
    message = resp.choices[0].message
    assert re.fullmatch(r"[a-z ]{4,20}", message.reasoning_content)
    assert re.fullmatch(r"[A-Z][a-z ]{4,30}\.", message.content)
    effort = _chat(harmony_client, final, reasoning_effort="high")  # OpenAI's field
    assert effort.usage.prompt_tokens > resp.usage.prompt_tokens  # the system line
    tool = {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = ANALYSIS + re.escape("<|channel|>commentary to=functions.get_weather "
                                '<|constrain|>json<|message|>{"city": "Paris"}')
    resp = _chat(harmony_client, call, tools=[tool])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert re.fullmatch(r"[a-z ]{4,20}", choice.message.reasoning_content)
    (got,) = choice.message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    chunks = list(_chat(harmony_client, call, stream=True, tools=[tool]))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert json.loads("".join(t.function.arguments or "" for t in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
