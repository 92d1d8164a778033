"""The cuda_ipc transport: same host, GPUs. The decode pool is exported with a CUDA IPC handle
and the prefill worker copies each layer device to device into the reserved blocks.

    decode worker (producer)                       prefill worker (consumer, other process)
    export_handle(pool)  -- reduce_tensor() -->    HandshakeResponse.cuda_ipc, field by field
                                                   open_handle(): rebuild_cuda_tensor(),
                                                   dst[layer].index_copy_(...), synchronize,
                                                   LayerDone RPC

Built on PyTorch's own IPC path (torch.multiprocessing.reductions): reduce_tensor() calls
storage._share_cuda_() for (device, cudaIpcMemHandle, storage size/offset, ref-counter file and
slot, cudaIpcEventHandle, event_sync_required); rebuild_cuda_tensor() opens it. Nothing is
unpickled: every field crosses the wire as a typed proto field, and the tensor class, storage
class and dtype come from this module, never from the peer.

Rules of CUDA IPC that shape this module:
- A handle opens only in another process on the same host, while the producer lives; the
  producer must keep the pool alive (it does: it is the decode KV cache).
- Each export takes a fresh ref-counter slot that the consumer releases when its tensor dies,
  so the receiver exports once per handshake (one slot per connection).
- The consumer's writes are complete only after it synchronizes; the LayerDone RPC is sent
  after torch.cuda.synchronize(), so the receiver never verifies bytes still in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing import reductions

from engine_core.kv_cache.layout import KVLayout
from kv_transfer.errors import TransportRefusedError
from kv_transfer.transports.base import Pair, ReceiverPool, device_type
from kv_transfer.transports.one_sided import OneSidedTransport
from protos.pdserve.internal import kv_transfer_pb2 as pb

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
# torch's storage handle is its own serialization around cudaIpcMemHandle_t (64 bytes): 66
# bytes under torch 2.11 on an H200, where a type tag comes first. Opaque here, but bounded.
MAX_MEM_HANDLE_BYTES = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CudaIpcTransport(OneSidedTransport):
    """Same host, both KV caches on CUDA: the sender opens the pool's IPC handle and copies
    each layer device to device. Its checksum is computed on the device (checksum.py: a host
    checksum would copy every layer off the GPU)."""

    name = "cuda_ipc"
    wire_kind = pb.TRANSPORT_KIND_CUDA_IPC
    checksum_kind = "sum32"
    auto_rank = 10

    def unavailable_reason(self, pair: Pair) -> str | None:
        if reason := pair.other_host_reason():
            return reason
        if device_type(pair.sender_device) != "cuda" or device_type(pair.receiver_device) != "cuda":
            return (f"needs CUDA on both sides (sender {pair.sender_device}, receiver "
                    f"{pair.receiver_device})")
        return None

    def sender_refusal(self, device: str) -> str | None:
        return None if torch.cuda.is_available() else "no CUDA in the sender"

    def receiver_refusal(self, device: str) -> str | None:
        if device_type(device) == "cuda":
            return None
        return f"cuda_ipc needs a KV cache on CUDA, this decode worker's is on {device}"

    def can_receive(self, pool: ReceiverPool) -> bool:
        return pool.kv_cache.is_cuda

    def export(self, pool: ReceiverPool) -> CudaIpcHandle:
        return export_handle(pool.kv_cache)  # a fresh ref-counter slot per handshake

    def export_to_proto(self, export: CudaIpcHandle, reply: pb.HandshakeResponse) -> None:
        reply.cuda_ipc.CopyFrom(handle_to_proto(export))

    def attach(self, reply: pb.HandshakeResponse, layout: KVLayout) -> torch.Tensor:
        handle = handle_from_proto(reply.cuda_ipc)
        try:
            return open_handle(handle, layout, reply.num_blocks)
        except (RuntimeError, OSError) as e:  # cudaIpcOpenMemHandle, or the ref-counter file
            raise TransportRefusedError(
                f"cuda_ipc cannot open the receiver's pool (GPU {handle.device_index}) here: "
                f"{e}; the workers must share /dev/shm and see each other's GPUs") from e


TRANSPORT = CudaIpcTransport()
# rebuild_cuda_tensor's parameters, in order; a test checks them against the installed torch.
REBUILD_PARAMS = (
    "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype",
    "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
    "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)


@dataclass(frozen=True)
class CudaIpcHandle:
    """What reduce_tensor() returns for the decode pool, as plain typed fields."""

    device_index: int
    mem_handle: bytes  # torch's storage handle (cudaIpcMemHandle_t inside), opaque
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes  # name of the producer's shared ref-counter file
    ref_counter_offset: int
    event_handle: bytes  # cudaIpcEventHandle_t, IPC_HANDLE_BYTES
    event_sync_required: bool
    tensor_size: tuple[int, ...]
    tensor_stride: tuple[int, ...]
    tensor_offset: int  # elements
    dtype: str  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        if not IPC_HANDLE_BYTES <= len(self.mem_handle) <= MAX_MEM_HANDLE_BYTES:
            raise ValueError(f"mem_handle must be {IPC_HANDLE_BYTES} to "
                             f"{MAX_MEM_HANDLE_BYTES} bytes, got {len(self.mem_handle)}")
        if self.event_sync_required and len(self.event_handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"event_handle must be {IPC_HANDLE_BYTES} bytes")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if len(self.tensor_size) != len(self.tensor_stride):
            raise ValueError("tensor_size and tensor_stride differ in length")
        if min(self.device_index, self.storage_size_bytes, self.storage_offset_bytes,
               self.ref_counter_offset, self.tensor_offset, *self.tensor_size) < 0:
            raise ValueError("negative size, offset or device index in a CUDA IPC handle")


def export_handle(pool: torch.Tensor) -> CudaIpcHandle:
    """Receiver side: an IPC handle for the decode KV pool (a fresh ref-counter slot)."""
    if not pool.is_cuda:
        raise TransportRefusedError(f"cuda_ipc needs the KV pool on a GPU, it is on "
                                    f"{pool.device}")
    rebuild, args = reductions.reduce_tensor(pool)
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise TransportRefusedError(f"torch shares this tensor with {rebuild.__name__}, "
                                    f"not rebuild_cuda_tensor")
    fields = dict(zip(REBUILD_PARAMS, args, strict=True))
    dtype = {v: k for k, v in _DTYPES.items()}[fields["dtype"]]
    return CudaIpcHandle(
        device_index=int(fields["storage_device"]), mem_handle=bytes(fields["storage_handle"]),
        storage_size_bytes=int(fields["storage_size_bytes"]),
        storage_offset_bytes=int(fields["storage_offset_bytes"]),
        ref_counter_handle=bytes(fields["ref_counter_handle"]),
        ref_counter_offset=int(fields["ref_counter_offset"]),
        event_handle=bytes(fields["event_handle"] or b""),
        event_sync_required=bool(fields["event_sync_required"]),
        tensor_size=tuple(fields["tensor_size"]), tensor_stride=tuple(fields["tensor_stride"]),
        tensor_offset=int(fields["tensor_offset"]), dtype=dtype)


def open_handle(handle: CudaIpcHandle, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Sender side: the receiver's pool [num_layers, num_blocks, 2, block_size, heads, dim],
    mapped into this process. Refuses anything but a contiguous pool of this layout."""
    if not torch.cuda.is_available():
        raise TransportRefusedError("cuda_ipc needs CUDA in the sender; none is available")
    shape = layout.cache_shape(num_blocks)
    if handle.tensor_size != shape or handle.dtype != layout.dtype:
        raise TransportRefusedError(f"exported pool is {handle.tensor_size} {handle.dtype}, "
                                    f"the layout needs {shape} {layout.dtype}")
    if handle.tensor_stride != torch.empty(shape, device="meta").stride():
        raise TransportRefusedError(f"exported pool is not contiguous: {handle.tensor_stride}")
    needed = (handle.tensor_offset + layout.num_layers * num_blocks * layout.block_numel) \
        * _DTYPES[handle.dtype].itemsize
    if needed > handle.storage_size_bytes:
        raise TransportRefusedError(f"exported storage holds {handle.storage_size_bytes} "
                                    f"bytes, the pool needs {needed}")
    return reductions.rebuild_cuda_tensor(
        torch.Tensor, torch.Size(handle.tensor_size), handle.tensor_stride,
        handle.tensor_offset, torch.storage.TypedStorage, _DTYPES[handle.dtype],
        handle.device_index, handle.mem_handle, handle.storage_size_bytes,
        handle.storage_offset_bytes, False, handle.ref_counter_handle,
        handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)


def handle_to_proto(h: CudaIpcHandle) -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle(
        device_index=h.device_index, mem_handle=h.mem_handle,
        storage_size_bytes=h.storage_size_bytes, storage_offset_bytes=h.storage_offset_bytes,
        ref_counter_handle=h.ref_counter_handle, ref_counter_offset=h.ref_counter_offset,
        event_handle=h.event_handle, event_sync_required=h.event_sync_required,
        tensor_size=h.tensor_size, tensor_stride=h.tensor_stride,
        tensor_offset=h.tensor_offset, dtype=h.dtype)


def handle_from_proto(msg: pb.CudaIpcHandle) -> CudaIpcHandle:
    """Validated field by field (ValueError on anything malformed)."""
    return CudaIpcHandle(
        device_index=msg.device_index, mem_handle=bytes(msg.mem_handle),
        storage_size_bytes=msg.storage_size_bytes,
        storage_offset_bytes=msg.storage_offset_bytes,
        ref_counter_handle=bytes(msg.ref_counter_handle),
        ref_counter_offset=msg.ref_counter_offset, event_handle=bytes(msg.event_handle),
        event_sync_required=msg.event_sync_required, tensor_size=tuple(msg.tensor_size),
        tensor_stride=tuple(msg.tensor_stride), tensor_offset=msg.tensor_offset,
        dtype=msg.dtype)
