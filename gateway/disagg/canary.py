"""The canary: health that proves the pipeline works, not just that processes answer.

    every CHECK_S, when no request has succeeded for idle_s (a busy stack sends none):
      for each (prefill P, decode D) pair, one synthetic request, max_tokens 1, through the
      whole remote path: D.Reserve -> P.Prefill (KV over the transport in use, committed and
      verified) -> D.Decode (on the gateway's output stream to D); bounded by timeout_s, aborted on D if it does not finish
      a pair that fails is marked bad: routing gives D another prefill worker while one is left
      (gateway/disagg/prefill_handoff.py); its next success clears the mark
    readiness: NOT_SERVING once `failures` rounds in a row had no pair succeed, or a round's
      canaries all timed out (a frozen worker keeps its connections: only time shows it);
      the next round with a success restores it. Liveness is not the canary's business.

A pure state machine (CanaryState) holds the verdicts; Canary runs the rounds against the
DisaggregatedBackend, which sends each request through probe().
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine_core.sampling_params import SamplingParams
from gateway.disagg.prefill_handoff import PrefillHandoff
from gateway.disagg.worker_calls import abort_on, gateway_error, time_left
from gateway.disagg.worker_pools import Worker
from protos.pdserve.internal import workers_pb2 as pb
from service_infra.backend import GenerateInput
from service_infra.proto_convert import sampling_to_proto

logger = logging.getLogger(__name__)
CHECK_S = 1.0  # how often the monitor looks at the idle time
READY_TIMEOUT_S = 5.0  # Decode's wait for the committed KV (normally already complete)
VERDICT_FILE = "canary.json"  # in the API servers' shared directory (gateway/api_servers.py)


@dataclass(frozen=True)
class CanaryConfig:
    """The gateway's --canary-idle-s (0: off), --canary-timeout-s and --canary-failures."""

    idle_s: float = 10.0
    timeout_s: float = 3.0
    failures: int = 3

    def __post_init__(self) -> None:
        if self.idle_s < 0 or self.timeout_s <= 0 or self.failures < 1:
            raise ValueError(f"canary_idle_s must be >= 0, canary_timeout_s > 0 and "
                             f"canary_failures >= 1, got {self.idle_s}, {self.timeout_s} and "
                             f"{self.failures}")

    @property
    def is_on(self) -> bool:
        return self.idle_s > 0


@dataclass
class CanaryState:
    """Verdicts of the rounds so far."""

    failures: int  # rounds in a row without a success that make readiness fail
    is_ready: bool = True
    num_failed_rounds: int = 0  # in a row
    bad_pairs: set[tuple[str, str]] = field(default_factory=set)  # (prefill, decode) address
    num_failures: dict[str, int] = field(default_factory=dict)  # by reason, since start
    last_success: float | None = None  # time.time() of the last successful canary
    last_latency_s: float | None = None

    def record(self, results: dict[tuple[str, str], tuple[str, float]], now: float) -> None:
        """One round: {(prefill, decode): (outcome, seconds)}, outcome "ok", "timeout" or
        another failure reason."""
        for pair, (outcome, seconds) in results.items():
            if outcome == "ok":
                self.bad_pairs.discard(pair)
                self.last_success = now
                self.last_latency_s = seconds
            else:
                self.bad_pairs.add(pair)
                self.num_failures[outcome] = self.num_failures.get(outcome, 0) + 1
        outcomes = [o for o, _ in results.values()]
        if "ok" in outcomes:
            self.num_failed_rounds = 0
            self.is_ready = True
            return
        self.num_failed_rounds += 1
        if self.num_failed_rounds >= self.failures or (outcomes and all(
                o == "timeout" for o in outcomes)):
            self.is_ready = False


class Canary:
    """Runs the rounds for a DisaggregatedBackend (which owns one and calls start/stop)."""

    def __init__(self, backend, config: CanaryConfig) -> None:
        self.backend = backend
        self.config = config
        self.state = CanaryState(config.failures)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.config.is_on:
            self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            idle = time.monotonic() - self.backend.last_success
            if idle >= self.config.idle_s:
                await self.round()

    async def round(self) -> None:
        """One canary per (prefill, decode) pair, one after the other."""
        results: dict[tuple[str, str], tuple[str, float]] = {}
        for prefill in list(self.backend.prefill):
            for decode in list(self.backend.decode):
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(self.backend.canary(prefill, decode,
                                                               self.config.timeout_s),
                                           self.config.timeout_s + 1.0)
                    outcome = "ok"
                except (TimeoutError, asyncio.TimeoutError):
                    outcome = "timeout"
                except Exception as e:  # any failure of the path counts, named
                    outcome = getattr(e, "reason", None) or type(e).__name__
                    if outcome == "DeadlineExceeded":
                        outcome = "timeout"
                results[prefill.address, decode.address] = (outcome, time.monotonic() - t0)
        was_ready = self.state.is_ready
        self.state.record(results, time.time())
        bad = {p: o for p, (o, _) in results.items() if o != "ok"}
        if bad:
            logger.warning("canary failed for %s", ", ".join(
                f"{p} -> {d}: {o}" for (p, d), o in bad.items()))
        if was_ready != self.state.is_ready:
            logger.warning("canary: readiness %s", "restored" if self.state.is_ready
                           else "lost (NOT_SERVING)")
        self.backend.last_success = time.monotonic() if "ok" in (
            o for o, _ in results.values()) else self.backend.last_success
        out = getattr(self.backend, "canary_verdict_out", None)
        if out is not None:  # the other API servers' readiness (gateway/api_servers.py)
            out.write(self.state.is_ready, self.status())

    def status(self) -> dict:
        s = self.state
        return {"enabled": self.config.is_on, "ready": s.is_ready,
                "failed_rounds_in_a_row": s.num_failed_rounds,
                "bad_pairs": [{"prefill": p, "decode": d} for p, d in sorted(s.bad_pairs)],
                "failures": dict(s.num_failures), "last_success": s.last_success,
                "last_latency_s": s.last_latency_s}


async def probe(handoff: PrefillHandoff, tokenizer, prefill: Worker, decode: Worker,
                timeout_s: float) -> None:
    """One synthetic request through the whole remote path of this pair: Reserve on decode,
    Prefill on prefill through `handoff` (the KV over the transport in use), Decode of one
    token. Raises what the path raised; whatever it leaves on decode is aborted."""
    prompt = (tokenizer.encode("ping") if tokenizer is not None else [1])[:1]
    inp = GenerateInput(f"canary-{uuid.uuid4().hex[:12]}", prompt,
                        SamplingParams(max_tokens=1, temperature=0.0),
                        deadline=time.monotonic() + timeout_s)
    sampling = sampling_to_proto(inp.params)
    is_done = False
    decode.in_flight += 1
    try:
        reservation = await decode.stub.Reserve(pb.ReserveRequest(
            request_id=inp.req_id, prompt_token_ids=prompt, sampling=sampling,
            lease_ttl_s=handoff.lease_ttl_s), timeout=time_left(inp))
        pre = await handoff.prefill_on(prefill, inp, sampling, decode, reservation)
        # the output stream, as every request's tokens (gateway/disagg/decode_stream.py)
        channel = decode.outputs.start(inp.req_id, inp.deadline, decode=pb.DecodeRequest(
            request_id=inp.req_id, first_token_id=pre.first_token_id,
            ready_timeout_s=READY_TIMEOUT_S))
        async for _ in channel:
            pass
        is_done = True
    except grpc.aio.AioRpcError as e:
        raise gateway_error(e, inp) from None
    finally:
        decode.in_flight -= 1
        if not is_done:
            await abort_on(decode, inp.req_id)


class CanaryVerdict:
    """The canary's verdict, as API server 0 (which runs it) writes it for the others
    (gateway/api_servers.py)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / VERDICT_FILE
        self._read_at = 0.0
        self._is_ready = True

    def write(self, is_ready: bool, status: dict) -> None:
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"ready": is_ready, "status": status}))
        tmp.replace(self.path)  # atomic: a reader sees the old or the new verdict

    def is_ready(self) -> bool:
        """Child 0's last verdict, re-read at most every 0.2 s (ready until one exists)."""
        now = time.monotonic()
        if now - self._read_at >= 0.2:
            self._read_at = now
            with contextlib.suppress(OSError, ValueError):
                self._is_ready = bool(json.loads(self.path.read_text())["ready"])
        return self._is_ready
