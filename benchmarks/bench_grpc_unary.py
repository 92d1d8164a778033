"""What a unary gRPC call costs the process that answers it: a grpc.aio server with a handler
that does nothing, called by a plain (sync) client in another process over loopback.

    python benchmarks/bench_grpc_unary.py [--calls 3000]

Prints the server process's CPU (all its threads: the event loop, gRPC's own) per call, and
the client's round trip. The decode worker answers Reserve as such a call for every request
(and Begin did, until the same-host control socket took it: kv_transfer/receiver/
control_server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys

import grpc

_CLIENT = """
import grpc, sys, time
n = int(sys.argv[2])
call = grpc.insecure_channel(sys.argv[1]).unary_unary(
    "/bench.Unary/Call", request_serializer=lambda b: b, response_deserializer=lambda b: b)
call(b"x")
t = time.perf_counter()
for _ in range(n):
    call(b"x")
print(f"client round trip: {(time.perf_counter() - t) / n * 1e6:.0f} us per call")
"""


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def main(calls: int) -> None:
    server = grpc.aio.server()

    async def handler(request, context):
        return b"ok"

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Unary", {
        "Call": grpc.unary_unary_rpc_method_handler(
            handler, request_deserializer=lambda b: b, response_serializer=lambda b: b)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cpu = _cpu_s()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, f"127.0.0.1:{port}", str(calls)])
    await asyncio.to_thread(client.wait)
    print(f"server process CPU: {(_cpu_s() - cpu) / (calls + 1) * 1e6:.0f} us per call")
    await server.stop(0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    asyncio.run(main(ap.parse_args().calls))
