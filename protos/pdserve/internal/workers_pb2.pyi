from protos.pdserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "num_prior_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParameters
    target: KVTarget
    num_prior_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParameters, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., num_prior_output_tokens: _Optional[int] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("transfer_address", "lease_id", "dst_block_ids", "first_block", "transport", "transfer_instance")
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    transfer_address: str
    lease_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    transport: str
    transfer_instance: str
    def __init__(self, transfer_address: _Optional[str] = ..., lease_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., transport: _Optional[str] = ..., transfer_instance: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "queue_s", "compute_s", "transfer_tail_s", "transfer_bytes", "transport", "num_cached_tokens", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAIL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _generate_pb2.TokenLogprob
    queue_s: float
    compute_s: float
    transfer_tail_s: float
    transfer_bytes: int
    transport: str
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., transfer_tail_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_ttl_s", "num_prior_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParameters
    lease_ttl_s: float
    num_prior_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParameters, _Mapping]] = ..., lease_ttl_s: _Optional[float] = ..., num_prior_output_tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "block_ids", "num_cached_tokens", "transfer_address", "transfer_instance")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    transfer_address: str
    transfer_instance: str
    def __init__(self, lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., transfer_address: _Optional[str] = ..., transfer_instance: _Optional[str] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "lease_ttl_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    lease_ttl_s: float
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("remaining_s",)
    REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    remaining_s: float
    def __init__(self, remaining_s: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "ready_timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: _generate_pb2.TokenLogprob
    ready_timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., ready_timeout_s: _Optional[float] = ...) -> None: ...

class LocalPrefillRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "max_chunk_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    max_chunk_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., max_chunk_tokens: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("request_id", "parent_request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    parent_request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParameters
    def __init__(self, request_id: _Optional[str] = ..., parent_request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParameters, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "num_cached_tokens", "first_decode_step_s", "queue_s", "prefill_s")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finish_reason: _generate_pb2.FinishReason
    num_cached_tokens: int
    first_decode_step_s: float
    queue_s: float
    prefill_s: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., first_decode_step_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("role", "model", "layout_fingerprint", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "num_reserved", "transfer_address", "block_size", "spec_num_drafts", "spec_num_accepted", "prefill_tokens_per_s", "decode_step_s", "kv_transfer_bytes_per_s", "kv_bytes_per_token", "prefix_block_hashes", "offload_load_tokens_per_s", "offload_block_hashes", "offload_tier_ids")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_LOAD_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_TIER_IDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    layout_fingerprint: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_reserved: int
    transfer_address: str
    block_size: int
    spec_num_drafts: _containers.RepeatedScalarFieldContainer[int]
    spec_num_accepted: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens_per_s: float
    decode_step_s: float
    kv_transfer_bytes_per_s: float
    kv_bytes_per_token: int
    prefix_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    offload_load_tokens_per_s: float
    offload_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    offload_tier_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_reserved: _Optional[int] = ..., transfer_address: _Optional[str] = ..., block_size: _Optional[int] = ..., spec_num_drafts: _Optional[_Iterable[int]] = ..., spec_num_accepted: _Optional[_Iterable[int]] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., kv_transfer_bytes_per_s: _Optional[float] = ..., kv_bytes_per_token: _Optional[int] = ..., prefix_block_hashes: _Optional[_Iterable[int]] = ..., offload_load_tokens_per_s: _Optional[float] = ..., offload_block_hashes: _Optional[_Iterable[int]] = ..., offload_tier_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("decode", "prefill_locally", "fork", "abort", "reserve", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    decode: DecodeRequest
    prefill_locally: LocalPrefillRequest
    fork: ForkRequest
    abort: AbortRequestRequest
    reserve: ReserveRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., prefill_locally: _Optional[_Union[LocalPrefillRequest, _Mapping]] = ..., fork: _Optional[_Union[ForkRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequestRequest, _Mapping]] = ..., reserve: _Optional[_Union[ReserveRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("request_ids", "num_tokens", "token_ids", "texts", "num_logprobs", "logprobs", "ends", "reserved")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    num_logprobs: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    ends: _containers.RepeatedCompositeFieldContainer[StreamEnd]
    reserved: _containers.RepeatedCompositeFieldContainer[StreamReserved]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., texts: _Optional[_Iterable[str]] = ..., num_logprobs: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[StreamEnd, _Mapping]]] = ..., reserved: _Optional[_Iterable[_Union[StreamReserved, _Mapping]]] = ...) -> None: ...

class StreamReserved(_message.Message):
    __slots__ = ("request_id", "reservation", "error_code", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation: ReserveResponse
    error_code: int
    error: str
    def __init__(self, request_id: _Optional[str] = ..., reservation: _Optional[_Union[ReserveResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("index", "finish_reason", "num_cached_tokens", "first_decode_step_s", "queue_s", "prefill_s", "error_code", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: _generate_pb2.FinishReason
    num_cached_tokens: int
    first_decode_step_s: float
    queue_s: float
    prefill_s: float
    error_code: int
    error: str
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., first_decode_step_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
