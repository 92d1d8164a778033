"""Discovery through a real Redis with the real model: `pdserve prefill`, `pdserve decode` and
`pdserve gateway` started separately with --redis-url (no addresses given to anyone), a greedy
completion, the prompt's blocks published by the prefill worker, then the decode worker killed
with SIGKILL: the gateway drops it within a few registration TTLs and takes a new decode worker
that registers later, without a restart."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
import redis

from engine_core.kv_cache.block_hash import hash_full_blocks
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from service_infra.redis_registry import block_member
from tests.e2e.stack import BLOCK_SIZE, LONG, N, greedy, out_ids, out_text, run
from tests.helpers import (
    kill_tree,
    log_tail,
    spawn_pdserve,
    stop_process,
    wait_for_output,
    wait_until,
)
from tests.redis_server import run_redis

TTL_S = 2.0  # --registration-ttl: a dead worker stays listed at most this long
STARTUP_TIMEOUT_S = 300
WORKER_READY = re.compile(r"READY (prefill|decode) (\S+)")
GATEWAY_READY = re.compile(r"pdserve gateway: gRPC (\S+)\s+HTTP (\S+)")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # like `pdserve up`'s pinned workers (and the reference)


def _status(http_url: str) -> tuple[int, dict]:
    r = httpx.get(f"{http_url}/internal/status", timeout=10)
    return r.status_code, r.json()


def _generate(grpc_addr: str) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(grpc_addr) as channel:
        return run(pb_grpc.GenerationStub(channel), pb.GenerateRequest(text=LONG,
                                                                       sampling=greedy(N)))


@pytest.mark.slow
def test_workers_found_in_redis_death_and_a_new_worker(tmp_path, request):
    with run_redis(tmp_path) as server:
        worker_flags = ["--port", "0", "--dtype", "float32", "--kv-cache-memory-gb", "0.25",
                        "--redis-url", server.url, "--registration-ttl", str(TTL_S)]
        procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        is_ok = False

        def spawn_decode(name: str) -> None:
            procs[name] = spawn_pdserve("decode", *worker_flags, "--transports", "grpc",
                                        name=name, env=ONE_THREAD)

        procs["prefill"] = spawn_pdserve("prefill", *worker_flags, name="prefill",
                                         env=ONE_THREAD)
        spawn_decode("decode")
        procs["gateway"] = spawn_pdserve("gateway", "--redis-url", server.url, "--transport",
                                         "grpc", "--port", "0", "--http-port", "0",
                                         name="gateway")
        try:
            ref = request.getfixturevalue("ref")  # loads while the workers load
            addr = {n: wait_for_output(p, log, WORKER_READY, STARTUP_TIMEOUT_S, n).group(2)
                    for n, (p, log) in procs.items() if n != "gateway"}
            m = wait_for_output(*procs["gateway"], GATEWAY_READY, STARTUP_TIMEOUT_S, "gateway")
            grpc_addr, http_url = m.group(1), m.group(2)
            code, status = _status(http_url)
            assert code == 200, status
            assert sorted((w["role"], w["address"], w["worker_id"], w["epoch"])
                          for w in status["workers"]) == [
                ("decode", addr["decode"], f"decode-{addr['decode'].replace(':', '-')}", 1),
                ("prefill", addr["prefill"], f"prefill-{addr['prefill'].replace(':', '-')}", 1)]

            expected = ref.generate(LONG, N)
            msgs = _generate(grpc_addr)
            assert out_ids(msgs) == expected.outputs[0].token_ids
            assert out_text(msgs) == expected.outputs[0].text
            # the prefill worker published the prompt's full blocks for routing
            r = redis.Redis(port=server.port, decode_responses=True)
            prefix_key = f"pdserve:prefix:prefill-{addr['prefill'].replace(':', '-')}"
            wanted = {block_member(h) for h in hash_full_blocks(expected.prompt_token_ids,
                                                                BLOCK_SIZE)}
            assert len(wanted) == 3
            wait_until(lambda: wanted <= set(r.zrange(prefix_key, 0, -1)), 5, "the prefix")

            procs["decode"][0].send_signal(signal.SIGKILL)
            procs["decode"][0].wait()
            killed = time.monotonic()

            def decode_gone():
                code, body = _status(http_url)
                return code == 503 and "decode: none" in body["error"]["message"]

            wait_until(decode_gone, 4 * TTL_S, "the gateway to drop the killed decode worker",
                       interval_s=0.1)
            dropped_after = time.monotonic() - killed
            print(f"the gateway dropped the killed decode worker after {dropped_after:.1f} s")
            assert dropped_after <= 4 * TTL_S
            assert r.keys("pdserve:worker:decode:*") == []

            spawn_decode("decode-2")  # joins: the gateway finds it in Redis
            addr["decode-2"] = wait_for_output(*procs["decode-2"], WORKER_READY,
                                               STARTUP_TIMEOUT_S, "decode-2").group(2)

            def decode_2_listed():
                code, body = _status(http_url)
                return code == 200 and [w["address"] for w in body["workers"]
                                        if w["role"] == "decode" and w["healthy"]]

            assert wait_until(decode_2_listed, 10, "the new decode worker") == [addr["decode-2"]]
            msgs = _generate(grpc_addr)
            assert out_ids(msgs) == expected.outputs[0].token_ids
            for name in ("gateway", "prefill", "decode-2"):  # graceful: deregisters
                assert stop_process(procs[name][0], 60) == 0, log_tail(procs[name][1])
            assert r.keys("pdserve:worker:*") == []
            r.close()
            for name in ("gateway", "prefill", "decode-2"):
                assert "Traceback" not in log_tail(procs[name][1], 10**7), name
            is_ok = True
        finally:
            for name, (proc, log) in procs.items():
                if proc.poll() is None:
                    kill_tree(proc)
                if is_ok:
                    log.unlink(missing_ok=True)
                else:  # shown with the failure
                    print(f"--- {name} ({log}) ---\n{log_tail(log)}")
