"""The KVTransfer gRPC service (grpc.aio): protobuf <-> KVReceiver calls, errors -> status codes
(errors.status_name, which the same-host socket of control_server.py answers with too):

    LayoutMismatchError, TransportRefusedError, LeaseError   FAILED_PRECONDITION
    UnknownLeaseError                                        NOT_FOUND
    LeaseEndedError                                          ABORTED
    VerificationError                                        DATA_LOSS
    ValueError (malformed request)                           INVALID_ARGUMENT

Serve it next to the decode service's other services, with the same-host socket beside it
(control_server.py) when one-sided transports are enabled:

    local = LocalControlServer(receiver).start()
    server = grpc.aio.server(options=list(GRPC_SERVER_OPTIONS.items()))
    add_kv_transfer_servicer(server, KVTransferServicer(receiver, local.path))

Handlers run on the event loop; the receiver's calls are short (a chunk copy holds the lease
table lock for ~100 us per MiB) except commit, which goes to a worker thread unless only a
short check is left of it (KVReceiver.commit_is_quick). A PushBlocks
stream that fails, is cancelled, or ends before all its layers are done ends its lease: a
transfer cannot resume. (grpc.aio ends the request iterator quietly when the peer dies, so
"ended early" is how a killed sender shows up.)
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kv_transfer import transports, wire
from kv_transfer.errors import status_name
from kv_transfer.negotiation import kind_from_proto, kind_to_proto
from kv_transfer.receiver.kv_receiver import KVReceiver
from protos.pdserve.internal import kv_transfer_pb2 as pb
from protos.pdserve.internal import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger("pdserve.kv_transfer")


async def _abort_with(context: grpc.aio.ServicerContext, error: Exception):
    """End the RPC with the status that matches `error`; unknown errors propagate (UNKNOWN)."""
    name = status_name(error)
    if name is not None:
        await context.abort(grpc.StatusCode[name], str(error))
    log.exception("KVTransfer handler failed", exc_info=error)
    raise error


class KVTransferServicer(pb_grpc.KVTransferServicer):
    """local_control_path: the receiver's LocalControlServer socket, offered to one-sided
    senders at handshake ("": none, their LayerDone and Commit come here)."""

    def __init__(self, receiver: KVReceiver, local_control_path: str = "") -> None:
        self.receiver = receiver
        self.local_control_path = local_control_path

    async def Handshake(self, request, context):
        try:
            result = self.receiver.handshake(
                wire.layout_from_proto(request.layout), kind_from_proto(request.transport),
                request.sender_host_id, request.sender_device, request.protocol_version)
        except Exception as e:
            await _abort_with(context, e)
        r = self.receiver
        reply = pb.HandshakeResponse(
            transport=kind_to_proto(result.kind), receiver_host_id=r.host_id,
            receiver_device=r.device, num_blocks=r.num_blocks,
            layout_fingerprint=r.layout.fingerprint(), max_chunk_bytes=r.max_chunk_bytes,
            receiver_instance=r.instance_id, protocol_version=wire.PROTOCOL_VERSION)
        transport = transports.get(result.kind)
        transport.export_to_proto(result.export, reply)
        if transport.is_one_sided and self.local_control_path:
            reply.local_control_path = self.local_control_path
            reply.local_control_begin = True
        return reply

    async def Begin(self, request, context):
        try:
            remaining_s = self.receiver.begin(request.lease_id, list(request.dst_block_ids),
                                              kind_from_proto(request.transport),
                                              (request.sender_pid, request.sender_start_ticks),
                                              request.receiver_instance)
        except Exception as e:
            await _abort_with(context, e)
        return pb.BeginResponse(remaining_ms=wire.to_ms(remaining_s))

    async def PushBlocks(self, request_iterator, context):
        lease_id, num_bytes, num_chunks = "", 0, 0
        try:
            async for request in request_iterator:
                item = request.WhichOneof("item")
                msg = request.chunk if item == "chunk" else request.layer_done
                if item is None:
                    raise ValueError("empty PushBlocksRequest")
                if lease_id and msg.lease_id != lease_id:
                    raise ValueError(f"one stream carries one lease: {lease_id}, then "
                                     f"{msg.lease_id}")
                lease_id = msg.lease_id
                if item == "chunk":
                    self.receiver.write_chunk(msg.lease_id, msg.layer, msg.dst_block_ids,
                                              msg.byte_offset, msg.data)
                    num_bytes += len(msg.data)
                    num_chunks += 1
                else:
                    self.receiver.layer_done(msg.lease_id, msg.layer, msg.crc32)
            if lease_id:
                self.receiver.stream_ended(lease_id)
        except asyncio.CancelledError:
            if lease_id:
                self.receiver.abort(lease_id, "push stream cancelled: sender gone or "
                                              "connection lost", writer_stopped=True)
            raise
        except Exception as e:
            if lease_id:
                self.receiver.abort(lease_id, f"push stream failed: {e}", writer_stopped=True)
            await _abort_with(context, e)
        return pb.PushBlocksResponse(num_bytes_received=num_bytes,
                                     num_chunks_received=num_chunks)

    async def LayerDone(self, request, context):
        try:
            remaining_s = self.receiver.layer_done(request.lease_id, request.layer,
                                                   request.crc32)
        except Exception as e:
            await _abort_with(context, e)
        return pb.LayerDoneResponse(remaining_ms=wire.to_ms(remaining_s))

    async def Commit(self, request, context):
        receiver, args = self.receiver, (request.lease_id, list(request.layer_crc32))
        try:
            if receiver.commit_is_quick(request.lease_id):  # a short check: no thread hop
                result = receiver.commit(*args)
            else:  # a long host checksum, or checks still queued: off the loop
                result = await asyncio.to_thread(receiver.commit, *args)
        except Exception as e:
            await _abort_with(context, e)
        return wire.commit_to_proto(result.num_bytes_verified, result.verify_seconds)

    async def Abort(self, request, context):
        was_live, state = self.receiver.abort(request.lease_id, request.reason,
                                              request.writer_stopped)
        return pb.AbortResponse(was_live=was_live, state=state)


def add_kv_transfer_servicer(server: grpc.aio.Server, servicer: KVTransferServicer) -> None:
    pb_grpc.add_KVTransferServicer_to_server(servicer, server)
