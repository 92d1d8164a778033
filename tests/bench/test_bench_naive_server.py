"""The naive server's HTTP API and its one-at-a-time lock, on a fake model (no weights), through
the bench's own HTTP client; and its per-token streamer on the real tokenizer."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx2 as httpx
import pytest
import torch

from pdserve.bench.client import HttpClient
from pdserve.bench.naive_server import NaiveServer, TokenStreamer, build_app
from pdserve.bench.workloads import BenchRequest

WORDS = " one two three four five six seven eight nine ten"


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from engine_core.model_files import resolve_model
    from engine_core.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(str(model_path)))


class FakeModel:
    """`generate` that streams fixed tokens, one every few ms, like transformers does: the
    prompt first, then each new token, then end(); it checks the stopping criteria."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls: list[dict] = []
        self.active = 0
        self.max_active = 0
        self.guard = threading.Lock()

    def generate(self, x, *, streamer, max_new_tokens, min_new_tokens, stopping_criteria,
                 **kwargs):
        with self.guard:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.calls.append({"max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens,
                           **kwargs})
        streamer.put(x)
        for i in range(max_new_tokens):
            time.sleep(0.003)
            streamer.put(torch.tensor([self.tokens[i % len(self.tokens)]]))
            if stopping_criteria(x, None).all():
                break
        with self.guard:
            self.active -= 1
        streamer.end()


@pytest.fixture()
def fake(tokenizer):
    model = FakeModel(tokenizer.encode(WORDS))
    server = NaiveServer(model, tokenizer, "fake-model", max_model_len=256)
    return model, httpx.ASGITransport(app=build_app(server))


def test_streams_one_event_per_token_with_usage(fake):
    model, transport = fake

    async def go():
        client = HttpClient("http://naive", api="completions", transport=transport)
        try:
            assert await client.model_id() == "fake-model"
            return await client.send(BenchRequest(output_len=6, input_len=0,
                                                  prompt_text="Count:", ignore_eos=True))
        finally:
            await client.close()

    r = asyncio.run(go())
    assert r.is_success, r.error
    assert (r.output_len, r.input_len) == (6, 2)  # the server's usage
    assert len(r.itl) == 5 and r.ttft > 0 and r.latency >= r.ttft
    # ignore_eos: transformers' min_new_tokens blocks EOS; greedy by default in the bench
    assert model.calls[0]["min_new_tokens"] == 6 and model.calls[0]["do_sample"] is False


def test_chat_and_completion_without_streaming(fake):
    _, transport = fake

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://naive") as http:
            chat = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
            text = await http.post("/v1/completions", json={"prompt": [1, 2, 3],
                                                            "max_tokens": 4})
            bad = await http.post("/v1/completions", json={"max_tokens": 4})
            return chat, text, bad

    chat, text, bad = asyncio.run(go())
    body = chat.json()
    assert body["choices"][0]["message"]["content"] == " one two three"
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    assert text.json()["choices"][0]["text"] == " one two three four"
    assert text.json()["usage"]["prompt_tokens"] == 3
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]


def test_one_request_generates_at_a_time(fake):
    model, transport = fake

    async def go():
        client = HttpClient("http://naive", api="completions", transport=transport)
        try:
            return await asyncio.gather(*(client.send(BenchRequest(
                output_len=5, input_len=0, prompt_text=f"Request {i}")) for i in range(3)))
        finally:
            await client.close()

    results = asyncio.run(go())
    assert all(r.is_success for r in results)
    assert len(model.calls) == 3 and model.max_active == 1


def test_token_streamer_flushes_every_token_but_never_half_a_character(tokenizer):
    ids = tokenizer.encode("Hé 🙂 ok")

    async def go():
        streamer = TokenStreamer(tokenizer.hf, skip_prompt=True, skip_special_tokens=True)
        streamer.put(torch.tensor([[5, 6]]))  # the prompt: skipped
        for t in ids:
            streamer.put(torch.tensor([t]))
        streamer.end()
        return [text async for text in streamer], streamer.num_tokens

    texts, num_tokens = asyncio.run(go())
    assert "".join(texts) == "Hé 🙂 ok"
    assert num_tokens == len(ids)
    assert not any("\ufffd" in t for t in texts)
    assert len(texts) >= 4  # not held back to whole words like the stock streamer
