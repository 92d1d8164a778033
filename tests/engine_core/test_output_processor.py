"""Incremental detokenization and stop strings, with the default model's real tokenizer.

The tokenizer is byte-level BPE: emoji and CJK characters are split over several tokens, so
single tokens decode to U+FFFD and the detokenizer has to hold them back.
"""

from __future__ import annotations

import random

import pytest

from engine_core.model_files import resolve_model
from engine_core.output_processor import RequestTextState, _held_back, advance_text, make_delta
from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello, world! How are you today?",
    "Café déjà vu — naïve façade, São Paulo, Zürich, Ærøskøbing",
    "日本語と中文的混合テキスト。你好，世界！",
    "Emoji: 😀👍🏽🎉 and a family 👨‍👩‍👧 on a 🚀",
    "mixed 😀 中文 café\n\tnew line   and  spaces ",
    "def f(x):\n    return x ** 2  # 𝛼 ≠ β\n",
    "Ünïcödé at the start, then ascii, then 🤖🤖🤖 at the end 中",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("Write something in several languages, please:")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


# -- Tokenizer ------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_vocab(tokenizer: Tokenizer):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.vocab_size == len(tokenizer.hf)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello world")) == ["Hello", "Ġworld"]


def test_decode_equals_transformers_decode(tokenizer: Tokenizer):
    """decode may skip transformers for the Rust tokenizer: the text must not change, with
    special tokens kept or skipped, on random ids (pieces of characters included)."""
    rng = random.Random(3)
    special = list(tokenizer.hf.all_special_ids)
    for _ in range(500):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 8))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(
                ids, skip_special_tokens=skip)


def test_tokenizer_eos_ids_merge_config_and_tokenizer(tokenizer: Tokenizer):
    hf_eos = tokenizer.hf.eos_token_id
    assert tokenizer.eos_token_ids == (hf_eos,)
    merged = Tokenizer(tokenizer.hf, eos_token_ids=(5, hf_eos, 5))
    assert merged.eos_token_ids == (5, hf_eos)  # config's first, no duplicates


def test_chat_template_keeps_special_tokens_whole(tokenizer: Tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    im_start, im_end = tokenizer.hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.count("<|im_start|>") == ids.count(im_start) == 3
    assert ids.count(im_end) == 2
    assert "Hi there" in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt


# -- IncrementalDetokenizer -----------------------------------------------------------------


def test_texts_split_characters_over_tokens(tokenizer: Tokenizer):
    """Guard: the test texts exercise the hold-back path at all."""
    ids = tokenizer.encode(TEXTS[3], add_special_tokens=False)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, prompt_ids, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    assert full == text  # the round trip itself is exact for these texts
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == full
    if REPLACEMENT not in full:
        for d in deltas:
            assert REPLACEMENT not in d, f"delta {d!r} splits a character"
    assert detok.prefix_offset <= detok.read_offset <= len(detok.ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_after_a_chat_prompt(tokenizer, text, skip_special_tokens):
    """The engine's usual prompt ends in special tokens ("<|im_start|>assistant\\n")."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    deltas = stream(detok, ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_of_the_stream_is_a_prefix_of_the_text(tokenizer, prompt_ids, text):
    """Nothing emitted is ever taken back, and what is emitted is all complete characters."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    emitted = ""
    for i in range(len(ids)):
        emitted += detok.push(ids[i : i + 1])
        assert text.startswith(emitted)
        visible = tokenizer.decode(ids[: i + 1])
        if visible.endswith(REPLACEMENT):
            # only the tokens of the unfinished character wait (with any text they carry)
            assert visible.rstrip(REPLACEMENT).startswith(emitted)
        else:
            assert emitted == visible  # nothing is held back once the character is complete


def test_random_split_characters(tokenizer):
    """Seeded fuzz over tokens that are pieces of multi-byte characters, mixed with ASCII,
    after a clean prompt: the stream only ever withholds an unfinished tail."""
    pieces = "😀👍🏽🎉中文café日本語🚀𝛼≠βÜnïcödé"
    multibyte = sorted(set(tokenizer.encode(pieces, add_special_tokens=False)))
    ascii_ids = tokenizer.encode(" a b c hello", add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(150):
        ids = [
            rng.choice(multibyte if rng.random() < 0.7 else ascii_ids)
            for _ in range(rng.randint(1, 12))
        ]
        detok = IncrementalDetokenizer(tokenizer, [rng.choice(ascii_ids) for _ in range(5)])
        out = "".join(stream(detok, ids))
        full = tokenizer.decode(ids)
        if full.endswith(REPLACEMENT):
            assert full.startswith(out), (ids, out, full)
        else:
            assert out == full, ids


def test_no_prompt_context_needed_for_a_leading_space(tokenizer):
    ids = tokenizer.encode(" leading space", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert "".join(stream(detok, ids)) == " leading space"


def test_prompt_ending_in_a_multibyte_character(tokenizer):
    prompt = tokenizer.encode("Say: 😀", add_special_tokens=False)
    ids = tokenizer.encode(" 中文 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(stream(detok, ids)) == " 中文 ok"


def test_special_tokens_are_skipped_or_kept(tokenizer, prompt_ids):
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("Done.", add_special_tokens=False) + [eos]
    skip = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    assert "".join(stream(skip, ids)) == "Done."
    keep = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False)
    assert "".join(stream(keep, ids)) == "Done." + tokenizer.hf.eos_token


# -- RequestTextState: stop strings -----------------------------------------------------------


def make_state(
    tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), **params
) -> RequestTextState:
    req = Request("r0", prompt_ids, SamplingParams(stop=stop, **params))
    return RequestTextState(req, tokenizer, "prompt")


def run_stream(
    state: RequestTextState, ids: list[int], finish_without_stop: bool = True
) -> tuple[list[str], bool]:
    """Push token by token, taking a delta after each like the engine. Returns the deltas and
    whether a stop string ended the stream."""
    deltas = []
    for i in range(len(ids)):
        stopped = state.push(ids[i : i + 1])
        last = i == len(ids) - 1
        deltas.append(state.take_delta(finished=stopped or (last and finish_without_stop)))
        if stopped:
            return deltas, True
    return deltas, False


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("Hello world. STOP here", ("STOP",), "Hello world. "),
        ("Answer: yes\n\nUser: next", ("\n\nUser:",), "Answer: yes"),
        ("Hello world", ("lo w",), "Hel"),  # the stop string starts inside a token
        ("abc 😀 def 😀 ghi", ("😀 d",), "abc "),  # multi-byte stop string
        ("one two three four", ("four", "two", "three"), "one "),  # the earliest match wins
        ("Café déjà vu", ("déjà",), "Café "),
    ],
)
def test_stop_string_cuts_the_text_before_it(tokenizer, prompt_ids, text, stop, expected):
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = make_state(tokenizer, prompt_ids, stop)
    deltas, stopped = run_stream(state, ids)
    assert stopped
    assert state.text == expected
    assert "".join(deltas) == expected
    assert state.stop_reason in stop
    assert text[len(expected) :].startswith(state.stop_reason)


@pytest.mark.parametrize(
    "text, stop",
    [
        ("Hello world. STOP here", ("STOP",)),
        ("Answer: yes\n\nUser: next", ("\n\nUser:",)),
        ("Answer: yes\n\nAssistant: no\n\nUser: bye", ("\n\nUser:",)),  # a false start
        ("STOmp STOP", ("STOP",)),
        ("aaab", ("ab",)),
        ("x 😀😀😀 y", ("😀😀 y!",)),
        ("the end is near, the end", ("the end.", "near!")),  # never matches
    ],
)
def test_streamed_text_is_never_retracted(tokenizer, prompt_ids, text, stop):
    """Every delta is part of the final text: no part of a stop string reaches the client."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = make_state(tokenizer, prompt_ids, stop)
    deltas, stopped = run_stream(state, ids)
    final = state.text
    emitted = ""
    for d in deltas:
        emitted += d
        assert final.startswith(emitted), f"emitted {emitted!r}, final text {final!r}"
    assert emitted == final
    for s in stop:
        assert s not in emitted


def test_random_stop_strings_match_a_per_token_reference(tokenizer, prompt_ids):
    """Seeded fuzz: the request ends at the first token after which the text contains a stop
    string, cut at the earliest such stop; nothing streamed before is ever taken back."""
    alphabet = ["a", "b", "ab", " ", "\n", "é", "😀", "ba", "the", " end"]
    rng = random.Random(0)
    num_stopped = 0
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        stops = tuple(
            sorted({"".join(rng.choices(alphabet, k=rng.randint(1, 3))) for _ in range(3)})
        )
        expected = text
        for k in range(1, len(ids) + 1):
            seen = tokenizer.decode(ids[:k])
            if seen.endswith(REPLACEMENT):
                continue
            starts = [seen.find(s) for s in stops if s in seen]
            if starts:
                expected = seen[: min(starts)]
                break
        state = make_state(tokenizer, prompt_ids, stops)
        deltas, stopped = run_stream(state, ids)
        num_stopped += stopped
        emitted = ""
        for d in deltas:
            emitted += d
            assert expected.startswith(emitted), (text, stops, emitted)
        assert emitted == state.text == expected, (text, stops)
    assert 20 < num_stopped < 140  # both outcomes were exercised


def test_partial_stop_string_is_held_back_while_running(tokenizer, prompt_ids):
    state = make_state(tokenizer, prompt_ids, ("\n\nUser:",))
    ids = tokenizer.encode("Answer: yes\n\nUser: next", add_special_tokens=False)
    # "Answer", ":", " yes", "\n", "\n", "User", ":"
    assert [tokenizer.decode([i]) for i in ids[:7]] == [
        "Answer",
        ":",
        " yes",
        "\n",
        "\n",
        "User",
        ":",
    ]
    emitted = []
    for i in range(6):
        assert not state.push(ids[i : i + 1])
        emitted.append(state.take_delta(finished=False))
    assert emitted == ["Answer", ":", " yes", "", "", ""]
    assert state.text == "Answer: yes\n\nUser"
    assert state.push(ids[6:7])
    assert state.text == "Answer: yes"
    assert state.stop_reason == "\n\nUser:"
    assert state.take_delta(finished=True) == ""


def test_held_back_text_is_released_when_it_is_not_a_stop(tokenizer, prompt_ids):
    state = make_state(tokenizer, prompt_ids, ("\n\nUser:",))
    ids = tokenizer.encode("yes\n\nAssistant", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["yes", "\n", "\n", "Ass", "istant"]
    deltas = []
    for i in range(len(ids)):
        assert not state.push(ids[i : i + 1])
        deltas.append(state.take_delta(finished=False))
    # "\n\nA" is no prefix of "\n\nUser:": the held-back newlines go out with "Ass"
    assert deltas == ["yes", "", "", "\n\nAss", "istant"]


def test_held_back_text_is_released_when_finished_without_stop(tokenizer, prompt_ids):
    state = make_state(tokenizer, prompt_ids, ("\n\nUser:",))
    ids = tokenizer.encode("Answer: yes\n\nUser", add_special_tokens=False)
    deltas, stopped = run_stream(state, ids, finish_without_stop=False)
    assert not stopped
    assert "".join(deltas) == "Answer: yes"
    assert state.take_delta(finished=True) == "\n\nUser"  # e.g. max_tokens ended it
    assert state.stop_reason is None
    assert state.take_delta(finished=True) == ""


def test_no_stop_strings_streams_everything(tokenizer, prompt_ids):
    state = make_state(tokenizer, prompt_ids)
    ids = tokenizer.encode("Answer: yes\n\nUser", add_special_tokens=False)
    deltas = []
    for i in range(len(ids)):
        assert not state.push(ids[i : i + 1])
        deltas.append(state.take_delta(finished=False))
    assert "".join(deltas) == "Answer: yes\n\nUser"


def test_without_a_tokenizer_there_is_no_text(prompt_ids):
    req = Request("r0", prompt_ids, SamplingParams(stop=("x",)))
    state = RequestTextState(req, None, None)
    assert state.push([1, 2, 3]) is False
    assert state.take_delta(finished=True) == ""


@pytest.mark.parametrize(
    "text, stops, expected",
    [
        ("hello", ("abc",), 0),
        ("hello a", ("abc",), 1),
        ("hello ab", ("abc",), 2),
        ("hello abc", ("abc",), 0),  # a whole stop string is not a *proper* prefix
        ("ab", ("abc", "bcd"), 2),
        ("xb", ("abc", "bcd"), 1),
        ("", ("abc",), 0),
        ("aa", ("ab",), 1),
    ],
)
def test_held_back_length(text, stops, expected):
    assert _held_back(text, stops) == expected


def test_deltas_report_text_tokens_and_the_stop(tokenizer, prompt_ids):
    """The engine's per-step path: advance_text then make_delta, token by token."""
    req = Request("r0", prompt_ids, SamplingParams(max_tokens=8, stop=("STOP",)))
    state = RequestTextState(req, tokenizer, "prompt text")
    ids = tokenizer.encode("Hello world. STOP here", add_special_tokens=False)
    deltas = []
    for token in ids:
        req.append_output_token(token)
        stopped = advance_text(req, state)
        if stopped:
            req.status = RequestStatus.FINISHED_STOPPED
        delta = make_delta(req, state, finished=stopped)
        assert delta.token_ids == [token]
        assert delta.num_output_tokens == req.num_output_tokens
        assert delta.is_first == (len(deltas) == 0)
        deltas.append(delta)
        if stopped:
            break
    assert deltas[0].prompt == "prompt text" and deltas[0].metrics is not None
    last = deltas[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "STOP"
    assert "".join(d.text for d in deltas) == "Hello world. "
    assert [t for d in deltas for t in d.token_ids] == req.output_token_ids


def test_deltas_without_stop_strings_carry_all_text_at_once(tokenizer, prompt_ids):
    """Several tokens in one step (speculative decoding): one delta with all their text."""
    req = Request("r0", prompt_ids, SamplingParams(max_tokens=16))
    state = RequestTextState(req, tokenizer, None)
    ids = tokenizer.encode("Hello world, again", add_special_tokens=False)
    for token in ids[:3]:
        req.append_output_token(token)
    assert not advance_text(req, state)
    first = make_delta(req, state, finished=False)
    for token in ids[3:]:
        req.append_output_token(token)
    assert not advance_text(req, state)
    req.status = RequestStatus.FINISHED_LENGTH
    second = make_delta(req, state, finished=True)
    assert first.token_ids == ids[:3] and second.token_ids == ids[3:]
    assert first.text + second.text == "Hello world, again"
    assert second.finish_reason == "length" and second.stop_reason is None
