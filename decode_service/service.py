"""The decode worker's gRPC service: protobuf in, engine types inside, status codes out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from decode_service.stream import DRAIN_POLL_S, OutputStream, Refused
from decode_service.worker import DecodeWorker, LeaseNotReady
from kv_transfer import LeaseEndedError, LeaseError, UnknownLeaseError
from protos.pdserve.internal import workers_pb2 as pb
from protos.pdserve.internal import workers_pb2_grpc as pb_grpc
from service_infra.backend import BackendUnavailable
from service_infra.proto_convert import (
    FINISH_REASONS,
    logprob_from_proto,
    logprob_to_proto,
    sampling_from_proto,
)

logger = logging.getLogger(__name__)
MAX_LEASE_TTL_S = 600.0


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, transfer_address: str,
                 transfer_instance: str = "", is_prefix_in_status: bool = True) -> None:
        """is_prefix_in_status: Status lists the prefix blocks held here (without Redis; with
        it the worker publishes them there instead)."""
        self.worker = worker
        self.is_prefix_in_status = is_prefix_in_status
        self.transfer_address = transfer_address
        self.transfer_instance = transfer_instance  # the KV receiver's instance_id
        self.streams: set[OutputStream] = set()  # the gateways' (Stream)
        self.is_draining = False

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        try:
            return await self.reserve(request)
        except Refused as e:
            await context.abort(e.code, str(e))

    async def reserve(self, request: pb.ReserveRequest) -> pb.ReserveResponse:
        """Reserve's answer, or Refused with the status the call ends with (the unary call
        and a stream's reserve message alike)."""
        if self.is_draining:  # the gateway reserves on another decode worker
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          "the decode worker is shutting down: no new reservations")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}") from None
        if not 0 < request.lease_ttl_s <= MAX_LEASE_TTL_S:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"lease_ttl_s must be in (0, {MAX_LEASE_TTL_S}], got "
                          f"{request.lease_ttl_s}")
        try:
            res = await self.worker.reserve(request.request_id, list(request.prompt_token_ids),
                                            params, request.lease_ttl_s,
                                            request.num_prior_output_tokens)
        except ValueError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except BackendUnavailable as e:
            raise Refused(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        if res is None:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "decode worker full: no free sequence slot or KV blocks now")
        return pb.ReserveResponse(lease_id=res.lease_id, block_ids=res.block_ids,
                                  num_cached_tokens=res.num_cached_tokens,
                                  transfer_address=self.transfer_address,
                                  transfer_instance=self.transfer_instance)

    async def Decode(self, request: pb.DecodeRequest, context):
        first_lp = (logprob_from_proto(request.first_logprob)
                    if request.HasField("first_logprob") else None)
        async for msg in self._stream(context, self.worker.decode(
                request.request_id, request.first_token_id, first_lp,
                request.ready_timeout_s or 5.0)):
            yield msg

    async def PrefillLocally(self, request: pb.LocalPrefillRequest, context):
        if request.max_chunk_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_chunk_tokens must be >= 1, got {request.max_chunk_tokens}")
        async for msg in self._stream(context, self.worker.prefill_locally(
                request.request_id, request.lease_id, request.max_chunk_tokens)):
            yield msg

    async def Fork(self, request: pb.ForkRequest, context):
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        if not request.parent_request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "parent_request_id must be set")
        async for msg in self._stream(context, self.worker.fork(
                request.request_id, request.parent_request_id,
                list(request.prompt_token_ids), params)):
            yield msg

    @staticmethod
    async def _stream(context, chunks):
        """The worker's chunks as DecodeResponse messages; the last carries the timings."""
        t_start, t_first, t_second = time.monotonic(), None, None
        num_tokens = 0
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    now = time.monotonic()
                    if t_first is None:  # a first chunk that carries a decoded token too: the
                        # step ran between the call and now, not in no time
                        t_first = now if len(chunk.token_ids) < 2 else t_start
                    num_tokens += len(chunk.token_ids)
                    if t_second is None and num_tokens >= 2:
                        t_second = now
                    msg = pb.DecodeResponse(token_ids=chunk.token_ids, text=chunk.text_delta)
                    for tok, entry in zip(chunk.token_ids, chunk.logprobs or (), strict=False):
                        msg.logprobs.append(logprob_to_proto(tok, entry))
                    if chunk.is_last:
                        msg.finish_reason = FINISH_REASONS[chunk.finish_reason]
                        msg.num_cached_tokens = chunk.num_cached_tokens
                        msg.first_decode_step_s = (t_second - t_first) if t_second else 0.0
                        if chunk.timing is not None:  # the engine's: a local prefill's split
                            msg.queue_s = chunk.timing.queue_s
                            msg.prefill_s = chunk.timing.prefill_s
                    yield msg
        except LeaseNotReady as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except BackendUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Stream(self, request_iterator, context) -> None:
        """A gateway's output stream (decode_service/stream.py)."""
        stream = OutputStream(self.worker, self.reserve)
        self.streams.add(stream)
        if self.is_draining:
            stream.drain()
        reader = asyncio.create_task(stream.read(context))
        try:
            await stream.write(context)
        finally:
            reader.cancel()
            stream.close()
            self.streams.discard(stream)

    def drain(self) -> None:
        """The worker is shutting down: no new reservations; what was reserved before still
        starts (its KV transfer and its start come after this), and every stream ends once its
        requests have and nothing reserved is left."""
        self.is_draining = True
        for stream in self.streams:
            stream.drain()

    async def drained(self) -> None:
        """Return once nothing is reserved here and every stream has ended: the server may
        stop taking calls then."""
        while self.worker.reservations or self.streams:
            await asyncio.sleep(DRAIN_POLL_S)

    async def RenewLease(self, request: pb.RenewLeaseRequest, context):
        if not 0 < request.lease_ttl_s <= MAX_LEASE_TTL_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"lease_ttl_s must be in (0, {MAX_LEASE_TTL_S}], got "
                                f"{request.lease_ttl_s}")
        try:
            remaining = self.worker.renew(request.request_id, request.lease_id,
                                          request.lease_ttl_s)
        except (UnknownLeaseError, LeaseEndedError) as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except LeaseError as e:  # the transfer has begun: its deadline stands
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.RenewLeaseResponse(remaining_s=remaining)

    async def Abort(self, request: pb.AbortRequestRequest, context):
        found = await self.worker.abort_anywhere(request.request_id,
                                                 request.reason or "aborted by the gateway")
        return pb.AbortRequestResponse(found=found)

    async def Status(self, request: pb.StatusRequest, context) -> pb.WorkerStatus:
        s = self.worker.status_now()
        eng = self.worker.engine
        return pb.WorkerStatus(
            role="decode", model=eng.source.name, layout_fingerprint=eng.layout.fingerprint(),
            block_size=eng.layout.block_size,
            num_blocks=s["num_blocks"], num_free_blocks=s["num_free_blocks"],
            num_running=s["num_running"], num_waiting=s["num_waiting"],
            num_reserved=s["num_reserved"], transfer_address=self.transfer_address,
            spec_num_drafts=s.get("speculative", {}).get("num_drafts", []),
            spec_num_accepted=s.get("speculative", {}).get("num_accepted", []),
            prefill_tokens_per_s=eng.stats.prefill_tokens_per_s,
            decode_step_s=eng.stats.decode_step_s,
            kv_bytes_per_token=eng.layout.bytes_per_token,
            prefix_block_hashes=self.worker.prefix.hashes() if self.is_prefix_in_status else ())
