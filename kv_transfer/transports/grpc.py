"""The grpc transport: KV bytes over a client-streaming PushBlocks call, for any two hosts.

Each layer becomes a run of chunks of at most `chunk_bytes` payload, then an in-stream
LayerDone carrying the layer's checksum (checksum.py), so the receiver sees a layer's end in
order with its bytes. Chunks hold whole blocks when a block fits, else pieces of one block:

    layer payload:  | blk 0 | blk 1 | blk 2 | blk 3 | blk 4 |      (dst order, block_nbytes each)
    chunk_bytes >= 2 blocks:  [0 1] [2 3] [4]                     byte_offset 0
    chunk_bytes < 1 block:    [0a] [0b] [1a] [1b] ...             byte_offset inside the block

Memory stays bounded: the session queue holds at most max_queued_layers snapshots, and gRPC's
request consumer pulls the next chunk only once the previous one has been written.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import torch

from kv_transfer.checksum import checksum_bytes, host_bytes
from kv_transfer.control_client import LocalControlClient
from kv_transfer.session import SendSession, _Stopped
from kv_transfer.transports.base import Transport
from protos.pdserve.internal import kv_transfer_pb2 as pb


def plan_chunks(num_blocks: int, block_nbytes: int,
                chunk_bytes: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(first block, block count, byte offset in the first block, payload start, payload end)
    for each chunk of a layer of `num_blocks` blocks; payload offsets index the snapshot."""
    if block_nbytes <= chunk_bytes:
        per_chunk = chunk_bytes // block_nbytes
        for first in range(0, num_blocks, per_chunk):
            count = min(per_chunk, num_blocks - first)
            yield first, count, 0, first * block_nbytes, (first + count) * block_nbytes
        return
    for block in range(num_blocks):
        for offset in range(0, block_nbytes, chunk_bytes):
            start = block * block_nbytes + offset
            yield block, 1, offset, start, start + min(chunk_bytes, block_nbytes - offset)


class GrpcTransport(Transport):
    """Any two hosts: the sender streams each layer in chunks and the receiver writes them
    (KVReceiver.write_chunk). Never refused, so "auto" falls back to it last."""

    name = "grpc"
    wire_kind = pb.TRANSPORT_KIND_GRPC
    auto_rank = 100

    def new_session(self, *args, pool: torch.Tensor | None,
                    local: LocalControlClient | None) -> SendSession:
        return GrpcSendSession(*args, kind=self.name, wire_kind=self.wire_kind)


TRANSPORT = GrpcTransport()


class GrpcSendSession(SendSession):
    is_two_sided = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._call: grpc.Future | None = None
        self._stream: torch.cuda.Stream | None = None  # a CUDA snapshot's copy to the host

    def _host_payload(self, blocks: torch.Tensor):
        """A layer's snapshot as host bytes. From a CUDA cache it is copied on the sender's
        own stream into pinned memory: on the thread's default stream, the copy would
        queue behind the model's later layers, already enqueued (the snapshot itself is
        complete: `_next_layer` waited for its event)."""
        if not blocks.is_cuda:
            return host_bytes(blocks)
        if self._stream is None:
            self._stream = torch.cuda.Stream(blocks.device)
        with torch.cuda.stream(self._stream):
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
            host.copy_(blocks, non_blocking=True)
            self._stream.synchronize()
        return host_bytes(host)

    def _pump(self) -> None:
        # No deadline on the stream: every layer delivered gives the lease its ttl again, so a
        # slow forward's transfer may outlast any deadline fixed at Begin (a 4k-token prompt
        # on a CPU takes minutes). The receiver's lease bounds it (a layer late by a ttl
        # expires it and fails the stream), _next_layer ends it when no layer comes, and
        # keepalive fails it if the receiver stops answering.
        call = self._stub.PushBlocks.future(self._requests())
        with self._lock:
            self._call = call
        self._check_alive()  # an abort that came before the call existed
        call.result()

    def _interrupt(self) -> None:
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def _requests(self) -> Iterator[pb.PushBlocksRequest]:
        """Runs in gRPC's request-consumer thread; ends the stream at commit or abort."""
        block_nbytes = self._layout.block_nbytes
        try:
            while (item := self._next_layer()) is not None:
                payload = self._host_payload(item.blocks)  # uint8 [n * block_nbytes]
                for first, count, offset, start, end in plan_chunks(
                        len(self._dst_ids), block_nbytes, self._options.chunk_bytes):
                    yield pb.PushBlocksRequest(chunk=pb.KVChunk(
                        lease_id=self.lease_id, layer=item.layer,
                        dst_block_ids=self._dst_ids[first:first + count], byte_offset=offset,
                        data=payload[start:end].tobytes()))
                    self._num_chunks += 1
                crc32 = checksum_bytes(payload)
                del payload  # (a view of a host snapshot, which _shipped frees for reuse)
                self._shipped(item, crc32)  # all chunks handed over, as copies
                yield pb.PushBlocksRequest(layer_done=pb.LayerDoneRequest(
                    lease_id=self.lease_id, layer=item.layer, crc32=crc32))
        except _Stopped:
            return  # abort() cancels the call; raising here would only add log noise
