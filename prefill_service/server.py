"""`pdserve prefill`: one prefill worker (what the helm chart's prefill Deployment runs)."""

from __future__ import annotations

import argparse
import logging

import uvloop

from gateway.colocated import ColocatedBackend
from pdserve.worker_args import engine_kwargs
from pdserve.worker_server import serve_worker
from prefill_service.engine import PrefillEngine
from prefill_service.service import PrefillServicer
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


async def _serve(args: argparse.Namespace) -> None:
    # a prefill worker never decodes: dense weights only
    engine = PrefillEngine(quantize_decode=False, **engine_kwargs(args))
    backend = ColocatedBackend(engine)
    servicer = PrefillServicer(engine, backend)

    def add(server) -> list[str]:
        pb_grpc.add_PrefillServicer_to_server(servicer, server)
        return [pb.DESCRIPTOR.services_by_name["Prefill"].full_name]

    async def close() -> None:
        servicer.close()
        await backend.close()

    await serve_worker("prefill", f"{args.host}:{args.port}", add, close, args.grace)


def run(args: argparse.Namespace) -> int:
    uvloop.run(_serve(args))
    return 0


