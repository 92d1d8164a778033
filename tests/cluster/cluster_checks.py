"""Checks and load shared by the cluster tests: requests through the gateway, each ending in an
Outcome; the workers' own view (Status, /metrics); quiescence and membership after a fault; a
readiness sampler."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.stack import ClusterStack, Worker
from protos.pdserve.internal import workers_pb2 as wpb
from protos.pdserve.internal import workers_pb2_grpc as wpb_grpc
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.stack import is_idle
from tests.helpers import wait_until


@dataclass
class Outcome:
    """How one request ended: its tokens, and the gRPC status code if it failed."""

    prompt: list[int]
    req_id: str = ""  # the gateway's, from the first message
    token_ids: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""
    seconds: float = 0.0  # from sending to the end (last message or error)
    t_first: float | None = None  # seconds to its first message
    timing: pb.Timing | None = None  # the last message's breakdown


def generate(target: str, prompt: list[int], max_tokens: int, timeout_s: float,
             on_token: Callable[[], None] | None = None,
             prompt_logprobs: int | None = None) -> Outcome:
    """One greedy streamed request (EOS ignored) by token ids; never raises for a failure.
    prompt_logprobs set: the prompt's too (which only the prefill pool computes)."""
    out = Outcome(prompt)
    t0 = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParameters(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
            prompt_logprobs=prompt_logprobs))
        try:
            for msg in stub.Generate(req, timeout=timeout_s):
                out.t_first = out.t_first or time.monotonic() - t0
                out.req_id = out.req_id or msg.request_id
                out.token_ids.extend(msg.token_ids)
                if msg.HasField("timing"):
                    out.timing = msg.timing
                if on_token is not None and msg.token_ids:
                    on_token()
        except grpc.RpcError as e:
            out.code, out.details = e.code(), e.details() or ""
    out.seconds = time.monotonic() - t0
    return out


class Load:
    """`n` requests, `concurrency` at a time, on threads; `futures` in submission order.
    `streaming` counts requests that received at least one token."""

    def __init__(self, cluster: ClusterStack, prompts: list[list[int]], max_tokens: int,
                 concurrency: int, timeout_s: float) -> None:
        self.pool = ThreadPoolExecutor(concurrency)
        self.started = threading.Semaphore(0)
        self._lock = threading.Lock()
        self.num_tokens = 0
        self.futures: list[Future[Outcome]] = [
            self.pool.submit(generate, cluster.grpc_addr, p, max_tokens, timeout_s, self._tick)
            for p in prompts]

    def _tick(self) -> None:
        with self._lock:
            self.num_tokens += 1

    def wait_tokens(self, n: int, timeout_s: float = 60) -> None:
        wait_until(lambda: self.num_tokens >= n, timeout_s, f"{n} tokens streamed")

    def results(self, timeout_s: float) -> list[Outcome]:
        try:
            return [f.result(timeout=timeout_s) for f in self.futures]
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)


class SteadyLoad:
    """`concurrency` clients, each sending the next of `prompts` (cycling) as soon as its last
    request ended, until stop(): then every outcome, in the order they ended."""

    def __init__(self, cluster: ClusterStack, prompts: list[list[int]], max_tokens: int,
                 concurrency: int, timeout_s: float) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(
            cluster.grpc_addr, prompts[i::concurrency] or prompts, max_tokens, timeout_s),
            daemon=True) for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def _client(self, target: str, prompts: list[list[int]], max_tokens: int,
                timeout_s: float) -> None:
        i = 0
        while not self._stop.is_set():
            self.outcomes.append(generate(target, prompts[i % len(prompts)], max_tokens,
                                          timeout_s))
            i += 1

    def stop(self, timeout_s: float = 120) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a client did not finish"
        return list(self.outcomes)


def status(worker: Worker, timeout_s: float = 5) -> wpb.WorkerStatus:
    stub_cls = wpb_grpc.PrefillStub if worker.role == "prefill" else wpb_grpc.DecodeStub
    with grpc.insecure_channel(worker.address) as channel:
        return stub_cls(channel).Status(wpb.StatusRequest(), timeout=timeout_s)


def scrape(url: str) -> list:
    """Every sample at a /metrics URL."""
    text = httpx.get(url, timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def sample_value(url: str, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(s.value for s in scrape(url) if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


def gateway_status(cluster: ClusterStack) -> dict:
    return httpx.get(f"{cluster.http_url}/internal/status", timeout=10).json()


def check_quiescent(cluster: ClusterStack, timeout_s: float = 30) -> None:
    """Within `timeout_s`: every live worker's pool is full again, nothing runs, waits or is
    reserved, no lease is active on any decode worker, and the gateway has no stream."""

    def busy() -> list[str]:
        out = []
        for w in cluster.live():
            try:
                s = status(w)
            except grpc.RpcError as e:
                out.append(f"{w.name}: Status failed {e.code().name}")
                continue
            if not is_idle(s):
                out.append(f"{w.name}: free {s.num_free_blocks}/{s.num_blocks}, running "
                           f"{s.num_running}, waiting {s.num_waiting}, reserved "
                           f"{s.num_reserved}")
            if w.role == "decode" and sample_value(w.metrics_url, "pdserve:kv_leases_active"):
                out.append(f"{w.name}: leases active")
        if gateway_status(cluster)["num_streams"]:
            out.append("gateway: streams left")
        return out

    last: list[list[str]] = []
    try:
        wait_until(lambda: not last.append(busy()) and not last[-1], timeout_s, "quiescence")
    except AssertionError:
        raise AssertionError(f"not quiescent after {timeout_s} s: {last[-1]}") from None


def check_membership(cluster: ClusterStack, timeout_s: float = 30) -> None:
    """Within `timeout_s`, the gateway routes over exactly the live workers, all healthy."""
    want = {(w.role, w.address) for w in cluster.live()}
    seen: list = []

    def converged() -> bool:
        got = {(w["role"], w["address"]): w["healthy"] for w in gateway_status(cluster)[
            "workers"]}
        seen.append(got)
        return set(got) == want and all(got.values())

    try:
        wait_until(converged, timeout_s, "membership", interval_s=0.2)
    except AssertionError:
        raise AssertionError(f"the gateway's workers {seen[-1]} != the live ones "
                             f"{sorted(want)} after {timeout_s} s") from None


class Readiness:
    """Samples the gateway's HTTP readiness every `period_s` on a thread, from start() to
    stop(): [(seconds since start, HTTP status or 0 when it did not answer)]."""

    def __init__(self, cluster: ClusterStack, period_s: float = 0.2) -> None:
        self.url, self.period_s = f"{cluster.http_url}/health/ready", period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        with httpx.Client(timeout=1.0) as client:
            while not self._stop.is_set():
                try:
                    code = client.get(self.url).status_code
                except httpx.HTTPError:
                    code = 0
                self.samples.append((time.monotonic() - t0, code))
                self._stop.wait(self.period_s)

    def __enter__(self) -> Readiness:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def not_ready(self) -> list[tuple[float, int]]:
        return [(round(t, 1), c) for t, c in self.samples if c != 200]
