"""`pdserve decode`: one decode worker (what the helm chart's decode Deployment runs).

Its gRPC server carries the Decode service and the KVTransfer service that prefill workers
write into; with shm enabled the KV pool lives in shared memory so that prefill workers on this
host copy straight into it.
"""

from __future__ import annotations

import argparse
import logging

import torch
import uvloop

from decode_service.service import DecodeServicer
from decode_service.worker import DecodeWorker
from engine_core.engine import LLMEngine
from kv_transfer import (
    KVReceiver,
    KVTransferServicer,
    LeaseTable,
    LocalControlServer,
    add_kv_transfer_servicer,
    negotiation,
    transports,
)
from protos.pdserve.internal import kv_transfer_pb2, workers_pb2
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra import tracing
from service_infra.metrics.worker import start_metrics, worker_registry
from service_infra.tls import tls_from_args
from service_infra.worker_args import engine_configs
from service_infra.worker_registration import (
    advertise_host,
    checked_redis_config,
    worker_registration,
)
from service_infra.worker_server import serve_worker

logger = logging.getLogger(__name__)


def accepted_transports(flag: str, device: torch.device) -> list[str]:
    """The KV transports a decode worker on `device` accepts, from its --transports flag
    (kv_transfer.negotiation.accepted_transports; SystemExit saying why one cannot work)."""
    try:
        return negotiation.accepted_transports(flag, str(device))
    except ValueError as e:
        raise SystemExit(str(e)) from None


async def _serve(args: argparse.Namespace) -> None:
    redis_config = await checked_redis_config(args)  # fails before the model loads
    tracing.setup("decode", tracing.instance_id(args), args.otlp_traces_endpoint)
    tls = tls_from_args(args, is_public=False)
    kinds: list[str] = []  # set by allocate(), once the engine's device is known
    pools: list = []  # the pool the KV cache lives in, when a transport made it (shm)

    def allocate(layout, num_blocks, device):
        kinds.extend(accepted_transports(args.transports, device))
        for kind in kinds:  # a transport may need the KV cache in its own pool (shm)
            pool = transports.get(kind).receiver_pool(layout, num_blocks)
            if pool is not None:
                pools.append(pool)
                return pool.tensor
        return layout.allocate(num_blocks, device)

    engine = LLMEngine(kv_allocator=allocate, **engine_configs(args))
    holder: dict[str, DecodeWorker] = {}
    table = LeaseTable(on_release=lambda lease, why: holder["w"].on_lease_released(lease, why))
    registration = worker_registration(redis_config, args, "decode", engine)
    worker = DecodeWorker(engine, table, on_prefix=registration.publish_prefix
                          if registration is not None else None)
    holder["w"] = worker
    start_metrics(worker_registry("decode", engine.source.name, engine, table), "decode", args)
    receiver = KVReceiver(engine.layout, engine.runner.kv_cache, table, kinds,
                          shm_pool=pools[0] if pools else None)
    # LayerDone and Commit of same-host senders on a Unix socket: a gRPC round trip less
    local = (LocalControlServer(receiver).start()
             if any(transports.get(k).is_one_sided for k in kinds) else None)
    servicer_box: dict[str, DecodeServicer] = {}

    def add(server) -> list[str]:
        add_kv_transfer_servicer(server, KVTransferServicer(receiver,
                                                            local.path if local else ""))
        servicer_box["s"] = DecodeServicer(worker, "", receiver.instance_id,
                                           is_prefix_in_status=registration is None)
        pb_grpc.add_DecodeServicer_to_server(servicer_box["s"], server)
        return [workers_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
                kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name]

    async def on_bound(port: int) -> None:
        servicer_box["s"].transfer_address = f"{advertise_host(args)}:{port}"

    async def close() -> None:
        await worker.close()
        if local is not None:
            local.close()
        receiver.close()
        for pool in pools:
            pool.close()

    await serve_worker("decode", f"{args.host}:{args.port}", add, close, args.grace, on_bound,
                       registration, tls, on_draining=lambda: servicer_box["s"].drain(),
                       drained=lambda: servicer_box["s"].drained())


def run(args: argparse.Namespace) -> int:
    uvloop.run(_serve(args))
    return 0
