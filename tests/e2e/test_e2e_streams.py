"""The token stream under a real `pdserve up` (a tiny random Llama, so that the stack loads in
seconds): a gateway killed while its output streams are open frees everything on the
workers; `--api-servers 2` spreads requests over two gateway processes on one port, sums
their metrics, and drains both on SIGTERM; a decode worker with async scheduling streams
the synchronous engine's greedy tokens."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx2 as httpx
import pytest

from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from tests.e2e.extra_gateway import ExtraGateway
from tests.e2e.stack import check_word_completions, metric, spawn_stack, stop_stack, wait_stack
from tests.helpers import kill_tree, log_tail
from tests.tiny_model import words, write_tiny_llama

pytestmark = pytest.mark.slow

PROMPTS = [[3 + (i * 11 + j) % 500 for j in range(20 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-streams")))


@pytest.fixture(scope="module")
def stack(tiny):
    """1 prefill + 2 decode workers, both with async scheduling on the CPU, float32."""
    s = wait_stack(*spawn_stack("--model", tiny, "--dtype", "float32", "--decode", "2",
                                "--kv-cache-memory-gb", "0.05", "--async-scheduling"))
    yield s
    assert stop_stack(s) == 0, log_tail(s.log)


def completion(url: str, prompt: list[int], max_tokens: int, stream: bool = False):
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": words(prompt), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream})


def test_async_scheduling_decode_workers_stream_the_synchronous_output(stack, tiny):
    """Both decode workers run async scheduling (passed by `pdserve up`) on the CPU; their
    greedy completions equal the offline engine's synchronous ones."""
    llm = LLM(tiny, dtype="float32", kv_cache_memory_gb=0.05, async_scheduling=False)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    check_word_completions(stack, PROMPTS, expected, 16)
    stack.wait_idle()


def test_the_stream_carries_logprobs_forks_and_finish_reasons(stack, tiny):
    """Through the output stream: n = 2 samples (a fork shares the parent's prompt KV),
    top-3 logprobs, and a stop string that ends one choice early, as the offline engine
    gives them."""
    llm = LLM(tiny, dtype="float32", kv_cache_memory_gb=0.05, async_scheduling=False)
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    ref = llm.generate([prompt], params)[0].outputs[0]
    stop = llm.tokenizer.decode([ref.token_ids[6]]).strip()  # a word of the greedy text
    r = httpx.post(f"{stack.http_url}/v1/completions", timeout=120, json={
        "prompt": words(prompt), "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "n": 2, "logprobs": 3, "stream": True})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    for index in (0, 1):
        choices = [c for e in events for c in e["choices"] if c["index"] == index]
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        lps = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert tokens == [llm.tokenizer.decode([t]) for t in ref.token_ids]
        assert lps == pytest.approx([d[t] for d, t in zip(ref.logprobs, ref.token_ids,
                                                          strict=True)], abs=1e-4)
        assert choices[-1]["finish_reason"] == "length"
    r = httpx.post(f"{stack.http_url}/v1/completions", timeout=120, json={
        "prompt": words(prompt), "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    stack.wait_idle()


def test_a_killed_gateway_leaves_nothing_held_on_the_workers(stack):
    gw = ExtraGateway(stack)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(completion, gw.http_url, p, 900, True) for p in PROMPTS]
        deadline = time.monotonic() + 60
        while sum(s.num_running for s in stack.status_all().values()) < len(PROMPTS):
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.05)
        kill_tree(gw.proc)  # SIGKILL, streams open: the workers see their streams end
        for f in futures:
            with pytest.raises(httpx.HTTPError):
                f.result().raise_for_status()
    gw.channel.close()
    stack.wait_idle(30)  # every block free, nothing running or reserved anywhere


def test_api_servers_share_the_ports_the_metrics_and_drain_together(stack):
    gw = ExtraGateway(stack, "--api-servers", "2")
    try:
        n = 24
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # a connection each
            results = list(pool.map(lambda i: completion(gw.http_url, PROMPTS[i % 6], 8),
                                    range(n)))
        assert all(r.status_code == 200 for r in results)
        served = {}
        deadline = time.monotonic() + 30
        while len(served) < 2 and time.monotonic() < deadline:  # new connections land on
            with httpx.Client() as client:                       # either process
                s = client.get(f"{gw.http_url}/internal/status", timeout=10).json()
            served[s["api_server"]] = s["num_requests"]
        assert sorted(served) == [0, 1] and all(v > 0 for v in served.values()), served
        assert sum(served.values()) == n
        time.sleep(1.5)  # the gauges are mirrored each second
        url = f"{gw.http_url}/metrics"
        assert metric(url, "pdserve:request_success_total", 'finished_reason="length"') == n
        assert metric(url, "pdserve:generation_tokens_total") == 8 * n
        assert metric(url, "pdserve:num_requests_running", 'pool="gateway"') == 0
        # SIGTERM while a request streams: both processes drain it, then all exit 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(completion, gw.http_url, PROMPTS[0], 300)
            time.sleep(1.0)
            gw.proc.send_signal(signal.SIGTERM)
            assert long.result().status_code == 200
            assert long.result().json()["usage"]["completion_tokens"] == 300
        assert gw.proc.wait(60) == 0, log_tail(gw.log)
    finally:
        if gw.proc.poll() is None:
            kill_tree(gw.proc)
        gw.channel.close()
    stack.wait_idle()
