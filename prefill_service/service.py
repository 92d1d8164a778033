"""The prefill worker's gRPC service: protobuf in, engine types inside, status codes out. The
work is the PrefillWorker's (prefill_service/worker.py); errors map to status codes:

    invalid fields, ValueError             -> INVALID_ARGUMENT
    TargetRefused (layout, transport)      -> FAILED_PRECONDITION
    KVTransferError (connect or transfer)  -> UNAVAILABLE "kv transfer failed: ..." (the
                                              gateway tells it from a lost prefill worker)
    PrefillAborted                         -> ABORTED
    Overloaded (the queue is full)         -> RESOURCE_EXHAUSTED: the gateway tries another
    DeadlineExceeded                       -> DEADLINE_EXCEEDED
    BackendUnavailable (engine failed, shutting down) -> UNAVAILABLE
"""

from __future__ import annotations

import time

import grpc

from kv_transfer import KVTransferError
from prefill_service.worker import KVDestination, PrefillAborted, PrefillWorker, TargetRefused
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra.backend import BackendUnavailable, DeadlineExceeded, Overloaded
from service_infra.proto_convert import (
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        t_received = time.monotonic()
        req_id, target = request.request_id, request.target
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        n_prompt = len(request.prompt_token_ids)
        num_blocks = -(-n_prompt // self.worker.engine.layout.block_size)
        if not req_id or n_prompt == 0 or len(target.dst_block_ids) != (
                num_blocks - target.first_block):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id and prompt_token_ids must be set and "
                                f"target.dst_block_ids must have {num_blocks} - first_block "
                                f"({target.first_block}) entries, got "
                                f"{len(target.dst_block_ids)}")
        if request.num_prior_output_tokens >= n_prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_prior_output_tokens must be < the prompt's "
                                f"{n_prompt} tokens, got {request.num_prior_output_tokens}")
        dest = KVDestination(target.transfer_address, target.transport or "auto",
                             target.transfer_instance, target.lease_id,
                             list(target.dst_block_ids), target.first_block)
        remaining = context.time_remaining()
        try:
            done = await self.worker.prefill(
                req_id, list(request.prompt_token_ids), params, request.num_prior_output_tokens,
                dest, arrival=t_received,
                deadline=None if remaining is None else t_received + remaining)
        except TargetRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KVTransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed: {e}")
        except PrefillAborted as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        except Overloaded as e:  # the queue is full: the gateway tries another prefill worker
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except DeadlineExceeded as e:  # the call's deadline, propagated by the gateway
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except BackendUnavailable as e:  # the engine failed or is shutting down
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        first, timing = done.first, done.first.timing
        reply = pb.PrefillResponse(
            first_token_id=first.token_ids[0], queue_s=timing.queue_s if timing else 0.0,
            compute_s=timing.prefill_s if timing else 0.0,
            transfer_tail_s=time.monotonic() - done.t_first, transfer_bytes=done.stats.num_bytes,
            transport=done.transport, num_cached_tokens=first.num_cached_tokens)
        if first.logprobs:
            reply.first_logprob.CopyFrom(logprob_to_proto(first.token_ids[0], first.logprobs[0]))
        if done.prompt_logprobs is not None:
            reply.prompt_logprobs.extend(
                prompt_logprobs_to_proto(list(request.prompt_token_ids), done.prompt_logprobs))
        return reply

    async def Status(self, request: pb.StatusRequest, context) -> pb.WorkerStatus:
        worker, engine = self.worker, self.worker.engine
        s = worker.backend.status_now()
        return pb.WorkerStatus(
            role="prefill", model=engine.source.name,
            layout_fingerprint=engine.layout.fingerprint(), num_blocks=s["num_blocks"],
            num_free_blocks=s["num_free_blocks"], num_running=s["num_running"],
            num_waiting=s["num_waiting"], block_size=engine.layout.block_size,
            prefill_tokens_per_s=engine.stats.prefill_tokens_per_s,
            decode_step_s=engine.stats.decode_step_s,
            kv_transfer_bytes_per_s=worker.kv_transfer_bytes_per_s,
            kv_bytes_per_token=engine.layout.bytes_per_token,
            prefix_block_hashes=worker.prefix.hashes() if worker.prefix is not None else (),
            offload_load_tokens_per_s=(engine.offloader.load_tokens_per_s
                                       if engine.offloader is not None else 0.0),
            offload_block_hashes=(worker.offloaded.hashes() if worker.offloaded is not None
                                  else ()),
            offload_tier_ids=worker.offload_tier_ids)
