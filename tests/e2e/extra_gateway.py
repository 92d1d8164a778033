"""Another gateway over a running stack's workers (tests/e2e/stack.py), with its own flags."""

from __future__ import annotations

import re

import grpc

from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.stack import STARTUP_TIMEOUT_S, Stack
from tests.helpers import log_tail, spawn_pdserve, stop_process, wait_for_output

GATEWAY_READY = re.compile(r"pdserve gateway: gRPC (\S+)\s+HTTP (\S+)")


class ExtraGateway:
    """Another gateway over a stack's workers, with its own flags and its own view of them:
    what it knows of each worker (load, the prefix blocks it holds) comes from their Status,
    as any gateway's does. `stop` asserts a clean exit."""

    def __init__(self, stack: Stack, *flags: str, transport: str = "shm") -> None:
        self.proc, self.log = spawn_pdserve(
            "gateway", "--prefill", *stack.prefill, "--decode", *stack.decode, "--port", "0",
            "--http-port", "0", "--transport", transport, "--canary-idle-s", "0", *flags,
            name="gateway-extra")  # no synthetic traffic: see spawn_stack
        m = wait_for_output(self.proc, self.log, GATEWAY_READY, STARTUP_TIMEOUT_S, "gateway")
        self.grpc_addr, self.http_url = m.group(1), m.group(2)
        self.channel = grpc.insecure_channel(self.grpc_addr)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        assert stop_process(self.proc) == 0, log_tail(self.log)
        assert "Traceback" not in log_tail(self.log, 10**6)
