from dsmesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_UNIFIED: _ClassVar[Role]

class HandoffState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_STATE_UNSPECIFIED: _ClassVar[HandoffState]
    HANDOFF_RESERVED: _ClassVar[HandoffState]
    HANDOFF_TRANSFERRING: _ClassVar[HandoffState]
    HANDOFF_DONE: _ClassVar[HandoffState]
    HANDOFF_FAILED: _ClassVar[HandoffState]
    HANDOFF_ABORTED: _ClassVar[HandoffState]
    HANDOFF_TIMED_OUT: _ClassVar[HandoffState]

class HandoffCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAUSE_UNSPECIFIED: _ClassVar[HandoffCause]
    CAUSE_LAYOUT_MISMATCH: _ClassVar[HandoffCause]
    CAUSE_PROMPT_MISMATCH: _ClassVar[HandoffCause]
    CAUSE_TIMED_OUT: _ClassVar[HandoffCause]
    CAUSE_CLIENT_ABORTED: _ClassVar[HandoffCause]
    CAUSE_PREFILL_LOST: _ClassVar[HandoffCause]
    CAUSE_DECODE_LOST: _ClassVar[HandoffCause]
    CAUSE_PREFILL_UNREACHABLE: _ClassVar[HandoffCause]
    CAUSE_PREFILL_FAILED: _ClassVar[HandoffCause]
    CAUSE_TRANSFER_FAILED: _ClassVar[HandoffCause]
    CAUSE_INVALID_REQUEST: _ClassVar[HandoffCause]
    CAUSE_BROKER_UNREACHABLE: _ClassVar[HandoffCause]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_UNIFIED: Role
HANDOFF_STATE_UNSPECIFIED: HandoffState
HANDOFF_RESERVED: HandoffState
HANDOFF_TRANSFERRING: HandoffState
HANDOFF_DONE: HandoffState
HANDOFF_FAILED: HandoffState
HANDOFF_ABORTED: HandoffState
HANDOFF_TIMED_OUT: HandoffState
CAUSE_UNSPECIFIED: HandoffCause
CAUSE_LAYOUT_MISMATCH: HandoffCause
CAUSE_PROMPT_MISMATCH: HandoffCause
CAUSE_TIMED_OUT: HandoffCause
CAUSE_CLIENT_ABORTED: HandoffCause
CAUSE_PREFILL_LOST: HandoffCause
CAUSE_DECODE_LOST: HandoffCause
CAUSE_PREFILL_UNREACHABLE: HandoffCause
CAUSE_PREFILL_FAILED: HandoffCause
CAUSE_TRANSFER_FAILED: HandoffCause
CAUSE_INVALID_REQUEST: HandoffCause
CAUSE_BROKER_UNREACHABLE: HandoffCause

class KVLayout(_message.Message):
    __slots__ = ("dtype", "page_size", "kv_dim", "num_layers", "model", "transport")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    page_size: int
    kv_dim: int
    num_layers: int
    model: str
    transport: str
    def __init__(self, dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., kv_dim: _Optional[int] = ..., num_layers: _Optional[int] = ..., model: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class RemotePool(_message.Message):
    __slots__ = ("transfer_session", "base_ptr", "num_pages", "page_bytes")
    TRANSFER_SESSION_FIELD_NUMBER: _ClassVar[int]
    BASE_PTR_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_session: str
    base_ptr: int
    num_pages: int
    page_bytes: int
    def __init__(self, transfer_session: _Optional[str] = ..., base_ptr: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("instance_id", "role", "grpc_address", "transfer_session")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SESSION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: Role
    grpc_address: str
    transfer_session: str
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., grpc_address: _Optional[str] = ..., transfer_session: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: Instance
    def __init__(self, instance: _Optional[_Union[Instance, _Mapping]] = ...) -> None: ...

class BrokerEvent(_message.Message):
    __slots__ = ("request_id", "state", "first_token_id", "message", "heartbeat", "prefill_released", "cause")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RELEASED_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: HandoffState
    first_token_id: int
    message: str
    heartbeat: bool
    prefill_released: bool
    cause: HandoffCause
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[HandoffState, str]] = ..., first_token_id: _Optional[int] = ..., message: _Optional[str] = ..., heartbeat: _Optional[bool] = ..., prefill_released: _Optional[bool] = ..., cause: _Optional[_Union[HandoffCause, str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "decode_instance_id", "layout", "pool", "page_ids", "num_tokens", "timeout_ms", "cached_pages", "cached_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_instance_id: str
    layout: KVLayout
    pool: RemotePool
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    timeout_ms: int
    cached_pages: int
    cached_prefix: int
    def __init__(self, request_id: _Optional[str] = ..., decode_instance_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., pool: _Optional[_Union[RemotePool, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., cached_pages: _Optional[int] = ..., cached_prefix: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("request_id", "prefill_instance_id", "layout", "wait_ms", "expected_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_instance_id: str
    layout: KVLayout
    wait_ms: int
    expected_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., wait_ms: _Optional[int] = ..., expected_ms: _Optional[int] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("decode_instance_id", "pool", "page_ids", "num_tokens", "cached_pages", "cached_prefix")
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_FIELD_NUMBER: _ClassVar[int]
    decode_instance_id: str
    pool: RemotePool
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    cached_pages: int
    cached_prefix: int
    def __init__(self, decode_instance_id: _Optional[str] = ..., pool: _Optional[_Union[RemotePool, _Mapping]] = ..., page_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., cached_pages: _Optional[int] = ..., cached_prefix: _Optional[int] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("request_id", "tokens_written", "bytes_written", "expected_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens_written: int
    bytes_written: int
    expected_ms: int
    def __init__(self, request_id: _Optional[str] = ..., tokens_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., expected_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "bytes_written", "first_token_logprobs", "draft_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    bytes_written: int
    first_token_logprobs: _generation_pb2.TokenLogprobs
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., bytes_written: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FailRequest(_message.Message):
    __slots__ = ("request_id", "reason", "cause")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    cause: HandoffCause
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., cause: _Optional[_Union[HandoffCause, str]] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AwaitRequest(_message.Message):
    __slots__ = ("request_id", "wait_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    wait_ms: int
    def __init__(self, request_id: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class HandoffStatus(_message.Message):
    __slots__ = ("request_id", "state", "first_token_id", "message", "decode_instance_id", "prefill_instance_id", "bytes_written", "prefill_released", "cause", "first_token_logprobs", "draft_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RELEASED_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: HandoffState
    first_token_id: int
    message: str
    decode_instance_id: str
    prefill_instance_id: str
    bytes_written: int
    prefill_released: bool
    cause: HandoffCause
    first_token_logprobs: _generation_pb2.TokenLogprobs
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[HandoffState, str]] = ..., first_token_id: _Optional[int] = ..., message: _Optional[str] = ..., decode_instance_id: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., bytes_written: _Optional[int] = ..., prefill_released: _Optional[bool] = ..., cause: _Optional[_Union[HandoffCause, str]] = ..., first_token_logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...
