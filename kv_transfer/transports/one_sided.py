"""The one-sided transports' common half (shm, cuda_ipc): the sender writes each layer
straight into the receiver's pool, mapped into this process, then reports it with LayerDone.
OneSidedTransport is their base (transports/base.py), OneSidedSendSession their session.

    for each queued layer snapshot:
        stop if the lease deadline is within WRITE_MARGIN_S (the receiver may free the blocks)
        dst[layer][dst_block_ids] = snapshot        # scatter_blocks: host or device
        synchronize the session's stream (CUDA)     # bytes in place before the receiver looks
        LayerDone(layer, checksum), not waited for  # up to MAX_LAYER_DONE_IN_FLIGHT pending
    Commit(every layer's checksum)                  # reports the last layer itself

The checksum is the transport's `checksum_kind`: XXH3 on the host over shm, a device-side
sum over cuda_ipc (checksum.py).
LayerDone and Commit travel on the receiver's Unix socket when the connection reached it
(control_client.py: a round trip of tens of microseconds), else as unary gRPC calls; so does
Begin where the receiver's handshake says it takes it there.

LayerDone calls are pipelined (a unary gRPC round trip costs 0.3-1 ms here, more than copying
a layer). That is safe because the receiver frees an aborted one-sided lease only on an explicit
Abort(writer_stopped=True), which this thread sends after it has stopped writing, or at the
deadline, which it stops writing WRITE_MARGIN_S before (as seen from the last reply: the
request's send time + the remaining time the receiver reported, a lower bound).

The layer that completes the set gets no LayerDone of its own: Commit carries its checksum, so
what the handoff adds after the prefill's last layer is one round trip, not two.

On CUDA the copies and checksums run on the session's own stream, and "in place" means that
stream has drained: the model keeps computing on its stream meanwhile (a device-wide
synchronize would wait for its later layers too).
"""

from __future__ import annotations

import time
from collections import deque

import grpc
import torch

from kv_transfer.blocks import scatter_blocks
from kv_transfer.checksum import checksum_tensor_as
from kv_transfer.control_client import LocalChannel, LocalControlClient
from kv_transfer.errors import TransferError
from kv_transfer.session import WRITE_MARGIN_S, SendSession, _Layer
from kv_transfer.transports.base import Transport
from protos.pdserve.internal import kv_transfer_pb2 as pb

MAX_LAYER_DONE_IN_FLIGHT = 8


class OneSidedTransport(Transport):
    """Base of the transports whose sender writes into the receiver's pool (attach() maps
    it); their sessions are OneSidedSendSession."""

    is_one_sided = True

    def new_session(self, *args, pool: torch.Tensor | None,
                    local: LocalControlClient | None) -> SendSession:
        assert pool is not None, f"{self.name}: attach() maps the receiver's pool first"
        return OneSidedSendSession(*args, kind=self.name, wire_kind=self.wire_kind,
                                   checksum_kind=self.checksum_kind, dst=pool, local=local)


class OneSidedSendSession(SendSession):
    """The sender writes each layer straight into the receiver's pool (`dst`, mapped into
    this process), then reports it with a LayerDone RPC."""

    def __init__(self, *args, dst: torch.Tensor, checksum_kind: str,
                 local: LocalControlClient | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # LayerDone and Commit over the receiver's Unix socket (control_client.py), on one
        # connection taken for the session; None: as unary gRPC calls
        self._local = local
        self._channel: LocalChannel | None = None
        self._checksum_kind = checksum_kind
        self._dst = dst  # [num_layers, num_blocks, 2, block_size, heads, dim], the pool
        # cuda_ipc: copies and checksums on a stream of their own (see the module docstring)
        self._stream = torch.cuda.Stream(dst.device) if dst.is_cuda else None
        # the destination block ids, on the pool's device once per transfer (CUDA)
        self._dst_index = (torch.as_tensor(self._dst_ids, dtype=torch.long, device=dst.device)
                           if dst.is_cuda else self._dst_ids)

    def _pump(self) -> None:
        # (send time, the LayerDone's gRPC call, or None: its reply comes on self._channel)
        in_flight: deque[tuple[float, grpc.Future | None]] = deque()
        try:
            while (item := self._next_layer()) is not None:
                self._harvest(in_flight, wait=len(in_flight) >= MAX_LAYER_DONE_IN_FLIGHT)
                if time.monotonic() > self._lease_deadline - WRITE_MARGIN_S:
                    raise TransferError("lease deadline too close to write safely", "CANCELLED")
                crc32 = self._write(item)
                self._shipped(item, crc32)  # bytes in place
                if len(self._crc32) == self._layout.num_layers:
                    continue  # the last layer: Commit reports it, one round trip sooner
                request = pb.LayerDoneRequest(lease_id=self.lease_id, layer=item.layer,
                                              crc32=crc32)
                in_flight.append((time.monotonic(), self._send_layer_done(request)))
            while in_flight:  # every layer acknowledged before Commit
                self._harvest(in_flight, wait=True)
        finally:
            for _, call in in_flight:
                if call is not None:
                    call.cancel()

    def _write(self, item: _Layer) -> int:
        """Copy one layer's snapshot into the receiver's blocks; its checksum, returned once
        the bytes are in place (the receiver may look as soon as it hears of the layer)."""
        with torch.cuda.stream(self._stream):  # None (shm): no stream, host memcpy
            scatter_blocks(self._dst, item.layer, self._dst_index, item.blocks)
            crc32 = checksum_tensor_as(self._checksum_kind, item.blocks)
            if self._stream is not None:  # (sum32's read-back has waited for the copy too)
                self._stream.synchronize()
        return crc32

    def _send_layer_done(self, request: pb.LayerDoneRequest) -> grpc.Future | None:
        channel = self._local_channel()
        if channel is None:
            return self._stub.LayerDone.future(request, timeout=self._options.rpc_timeout_s)
        channel.send(pb.LocalControlRequest(layer_done=request))
        return None

    def _harvest(self, in_flight: deque, wait: bool) -> None:
        """Collect finished LayerDone replies (the oldest first; raises if one failed) and
        refresh the lease deadline from them. `wait`: block for at least the oldest."""
        while in_flight and (wait or self._is_answered(in_flight[0][1])):
            sent, call = in_flight.popleft()
            # grpc.RpcError or TransferError if the receiver refused the layer
            reply = (call.result() if call is not None else self._channel.reply(
                "layer_done", self._options.rpc_timeout_s).layer_done)
            self._lease_deadline = sent + reply.remaining_ms / 1000
            wait = False

    def _is_answered(self, call: grpc.Future | None) -> bool:
        return call.done() if call is not None else self._channel.has_reply()

    def _begin_rpc(self, request: pb.BeginRequest) -> pb.BeginResponse:
        if self._local is None or not self._local.takes_begin:
            return super()._begin_rpc(request)
        channel = self._local_channel()
        if channel is None:  # the receiver's connections are full: gRPC, as the rest
            return super()._begin_rpc(request)
        channel.send(pb.LocalControlRequest(begin=request))
        return channel.reply("begin", self._options.rpc_timeout_s).begin

    def _commit_rpc(self, request: pb.CommitRequest) -> pb.CommitResponse:
        channel = self._local_channel()
        if channel is None:
            return super()._commit_rpc(request)
        channel.send(pb.LocalControlRequest(commit=request))
        return channel.reply("commit", self._options.commit_timeout_s).commit

    def _local_channel(self) -> LocalChannel | None:
        """The session's connection to the receiver's socket, taken at its first message;
        None: the control is on gRPC (no socket, or the receiver's connections are full)."""
        if self._channel is None and self._local is not None:
            try:
                self._channel = self._local.take()
            except TransferError as e:
                if e.code != "RESOURCE_EXHAUSTED":
                    raise
                self._local = None  # this transfer only: the next one tries the socket again
        return self._channel

    def _finish(self) -> None:
        if self._channel is not None:  # kept for the next session only if nothing is pending
            self._local.give_back(self._channel)
            self._channel = None
