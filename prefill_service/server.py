"""`pdserve prefill`: one prefill worker (what the helm chart's prefill Deployment runs)."""

from __future__ import annotations

import argparse
import logging

import torch
import uvloop

from engine_core.kv_cache.block_hash import hash_full_blocks
from engine_core.model_files import resolve_model
from engine_core.platforms import resolve_dtype
from engine_core.platforms.cpu.weights import settle_prefill_weights
from prefill_service.engine import PrefillEngine
from prefill_service.service import PrefillServicer
from prefill_service.worker import PrefillWorker
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra import tracing
from service_infra.colocated import ColocatedBackend
from service_infra.metrics.worker import KVTransferMetrics, start_metrics, worker_registry
from service_infra.prefix_record import MAX_OFFLOAD_RECORD_BLOCKS, PrefixRecord
from service_infra.redis_registry import OFFLOAD_PREFIX_TTL_S
from service_infra.tls import tls_from_args
from service_infra.worker_args import engine_configs
from service_infra.worker_registration import (
    advertise_host,
    checked_redis_config,
    worker_registration,
)
from service_infra.worker_server import serve_worker

logger = logging.getLogger(__name__)


async def _serve(args: argparse.Namespace) -> None:
    redis_config = await checked_redis_config(args)  # fails before the model loads
    tracing.setup("prefill", tracing.instance_id(args), args.otlp_traces_endpoint)
    tls = tls_from_args(args, is_public=False)
    # a prefill worker never decodes: no 4/8-bit twins, unless its prefill rows multiply the
    # GGUF's blocks (--prefill-weights quantized, or auto choosing it)
    weights = settle_prefill_weights(args.prefill_weights, resolve_model(args.model),
                                     resolve_dtype(args.dtype, torch.device("cpu")))
    engine = PrefillEngine(kv_push=args.kv_push, **engine_configs(
        args, quantize_decode=weights == "quantized", prefill_weights=weights))
    registry = worker_registry("prefill", engine.source.name, engine)
    start_metrics(registry, "prefill", args)
    backend = ColocatedBackend(engine, max_waiting=args.max_waiting)
    # with offload tiers, a prompt's blocks are stored there too (write-through) and outlive
    # the pool: recorded apart, bounded by the tiers' size
    offloader = engine.offloader
    num_offload_blocks = (min(offloader.capacity_blocks, MAX_OFFLOAD_RECORD_BLOCKS)
                          if offloader is not None else 0)
    registration = worker_registration(redis_config, args, "prefill", engine,
                                       num_offload_blocks)
    # a prompt's full blocks stay in this worker's prefix cache: the gateways route by them
    # and count them in a remote prefill's cost, read from Redis where there is one, else
    # from Status
    prefix = offloaded = None
    if registration is None:
        prefix = PrefixRecord(max(1, engine.num_kv_blocks))
        if num_offload_blocks:
            offloaded = PrefixRecord(num_offload_blocks, ttl_s=OFFLOAD_PREFIX_TTL_S)
    block_size = engine.layout.block_size

    def on_prefilled(prompt_token_ids: list[int]) -> None:
        hashes = hash_full_blocks(prompt_token_ids, block_size)
        if registration is not None:
            registration.publish_prefix(hashes)
            if num_offload_blocks:
                registration.publish_offloaded(hashes)
        else:
            prefix.add(hashes)
            if offloaded is not None:
                offloaded.add(hashes)

    transfer_metrics = KVTransferMetrics(registry, engine.source.name)
    worker = PrefillWorker(engine, backend, transfer_metrics, on_prefilled, tls, prefix,
                           offloaded)
    servicer = PrefillServicer(worker)

    async def on_bound(port: int) -> None:  # the `prefill` label of kv_transport_info
        transfer_metrics.set_prefill(
            getattr(args, "worker_id", None) or f"{advertise_host(args)}:{port}")

    def add(server) -> list[str]:
        pb_grpc.add_PrefillServicer_to_server(servicer, server)
        return [pb.DESCRIPTOR.services_by_name["Prefill"].full_name]

    async def close() -> None:
        worker.close()
        await backend.close()

    await serve_worker("prefill", f"{args.host}:{args.port}", add, close, args.grace,
                       announcer=registration, tls=tls, on_bound=on_bound)


def run(args: argparse.Namespace) -> int:
    uvloop.run(_serve(args))
    return 0


