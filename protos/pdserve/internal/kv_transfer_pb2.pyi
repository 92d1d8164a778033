from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_AUTO: _ClassVar[TransportKind]
    TRANSPORT_KIND_GRPC: _ClassVar[TransportKind]
    TRANSPORT_KIND_SHM: _ClassVar[TransportKind]
    TRANSPORT_KIND_CUDA_IPC: _ClassVar[TransportKind]
TRANSPORT_KIND_AUTO: TransportKind
TRANSPORT_KIND_GRPC: TransportKind
TRANSPORT_KIND_SHM: TransportKind
TRANSPORT_KIND_CUDA_IPC: TransportKind

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "transport", "sender_host_id", "sender_device", "protocol_version")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SENDER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    transport: TransportKind
    sender_host_id: str
    sender_device: str
    protocol_version: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., transport: _Optional[_Union[TransportKind, str]] = ..., sender_host_id: _Optional[str] = ..., sender_device: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("transport", "receiver_host_id", "receiver_device", "num_blocks", "layout_fingerprint", "max_chunk_bytes", "shm", "cuda_ipc", "receiver_instance", "local_control_path", "protocol_version", "local_control_begin")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CONTROL_PATH_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CONTROL_BEGIN_FIELD_NUMBER: _ClassVar[int]
    transport: TransportKind
    receiver_host_id: str
    receiver_device: str
    num_blocks: int
    layout_fingerprint: str
    max_chunk_bytes: int
    shm: ShmPool
    cuda_ipc: CudaIpcHandle
    receiver_instance: str
    local_control_path: str
    protocol_version: int
    local_control_begin: bool
    def __init__(self, transport: _Optional[_Union[TransportKind, str]] = ..., receiver_host_id: _Optional[str] = ..., receiver_device: _Optional[str] = ..., num_blocks: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., shm: _Optional[_Union[ShmPool, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., receiver_instance: _Optional[str] = ..., local_control_path: _Optional[str] = ..., protocol_version: _Optional[int] = ..., local_control_begin: _Optional[bool] = ...) -> None: ...

class ShmPool(_message.Message):
    __slots__ = ("path", "size_bytes", "st_dev", "st_ino")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ST_DEV_FIELD_NUMBER: _ClassVar[int]
    ST_INO_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    st_dev: int
    st_ino: int
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., st_dev: _Optional[int] = ..., st_ino: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_index", "mem_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_size", "tensor_stride", "tensor_offset", "dtype")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_STRIDE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    mem_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_size: _containers.RepeatedScalarFieldContainer[int]
    tensor_stride: _containers.RepeatedScalarFieldContainer[int]
    tensor_offset: int
    dtype: str
    def __init__(self, device_index: _Optional[int] = ..., mem_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_size: _Optional[_Iterable[int]] = ..., tensor_stride: _Optional[_Iterable[int]] = ..., tensor_offset: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class BeginRequest(_message.Message):
    __slots__ = ("lease_id", "dst_block_ids", "transport", "sender_pid", "sender_start_ticks", "receiver_instance")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SENDER_PID_FIELD_NUMBER: _ClassVar[int]
    SENDER_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport: TransportKind
    sender_pid: int
    sender_start_ticks: int
    receiver_instance: str
    def __init__(self, lease_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., transport: _Optional[_Union[TransportKind, str]] = ..., sender_pid: _Optional[int] = ..., sender_start_ticks: _Optional[int] = ..., receiver_instance: _Optional[str] = ...) -> None: ...

class BeginResponse(_message.Message):
    __slots__ = ("remaining_ms",)
    REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    remaining_ms: int
    def __init__(self, remaining_ms: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("lease_id", "layer", "dst_block_ids", "byte_offset", "data")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    layer: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    byte_offset: int
    data: bytes
    def __init__(self, lease_id: _Optional[str] = ..., layer: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., byte_offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushBlocksRequest(_message.Message):
    __slots__ = ("chunk", "layer_done")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAYER_DONE_FIELD_NUMBER: _ClassVar[int]
    chunk: KVChunk
    layer_done: LayerDoneRequest
    def __init__(self, chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., layer_done: _Optional[_Union[LayerDoneRequest, _Mapping]] = ...) -> None: ...

class PushBlocksResponse(_message.Message):
    __slots__ = ("num_bytes_received", "num_chunks_received")
    NUM_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    num_bytes_received: int
    num_chunks_received: int
    def __init__(self, num_bytes_received: _Optional[int] = ..., num_chunks_received: _Optional[int] = ...) -> None: ...

class LayerDoneRequest(_message.Message):
    __slots__ = ("lease_id", "layer", "crc32")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    layer: int
    crc32: int
    def __init__(self, lease_id: _Optional[str] = ..., layer: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class LayerDoneResponse(_message.Message):
    __slots__ = ("remaining_ms",)
    REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    remaining_ms: int
    def __init__(self, remaining_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "layer_crc32")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_CRC32_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    layer_crc32: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., layer_crc32: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_bytes_verified", "verify_us")
    NUM_BYTES_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_US_FIELD_NUMBER: _ClassVar[int]
    num_bytes_verified: int
    verify_us: int
    def __init__(self, num_bytes_verified: _Optional[int] = ..., verify_us: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("lease_id", "reason", "writer_stopped")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WRITER_STOPPED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reason: str
    writer_stopped: bool
    def __init__(self, lease_id: _Optional[str] = ..., reason: _Optional[str] = ..., writer_stopped: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("was_live", "state")
    WAS_LIVE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    was_live: bool
    state: str
    def __init__(self, was_live: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class LocalControlRequest(_message.Message):
    __slots__ = ("layer_done", "commit", "hello", "begin")
    LAYER_DONE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    layer_done: LayerDoneRequest
    commit: CommitRequest
    hello: bool
    begin: BeginRequest
    def __init__(self, layer_done: _Optional[_Union[LayerDoneRequest, _Mapping]] = ..., commit: _Optional[_Union[CommitRequest, _Mapping]] = ..., hello: _Optional[bool] = ..., begin: _Optional[_Union[BeginRequest, _Mapping]] = ...) -> None: ...

class LocalControlReply(_message.Message):
    __slots__ = ("layer_done", "commit", "receiver_instance", "error", "begin")
    LAYER_DONE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    layer_done: LayerDoneResponse
    commit: CommitResponse
    receiver_instance: str
    error: LocalControlError
    begin: BeginResponse
    def __init__(self, layer_done: _Optional[_Union[LayerDoneResponse, _Mapping]] = ..., commit: _Optional[_Union[CommitResponse, _Mapping]] = ..., receiver_instance: _Optional[str] = ..., error: _Optional[_Union[LocalControlError, _Mapping]] = ..., begin: _Optional[_Union[BeginResponse, _Mapping]] = ...) -> None: ...

class LocalControlError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
