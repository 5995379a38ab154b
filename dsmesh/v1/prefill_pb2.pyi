from dsmesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling", "resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "prompt_tokens", "cached_tokens", "kv_bytes", "kv_write_us", "handoff_us", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_WRITE_US_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_US_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    prompt_tokens: int
    cached_tokens: int
    kv_bytes: int
    kv_write_us: int
    handoff_us: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_write_us: _Optional[int] = ..., handoff_us: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PrefixCursor(_message.Message):
    __slots__ = ("epoch", "seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class PrefixDigest(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "page_size", "stored", "removed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    reset: bool
    page_size: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., page_size: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("prefixes",)
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    prefixes: PrefixCursor
    def __init__(self, prefixes: _Optional[_Union[PrefixCursor, _Mapping]] = ...) -> None: ...

class PrefillLoad(_message.Message):
    __slots__ = ("instance_id", "waiting_tokens", "running_requests", "free_pages", "total_pages", "max_queued_tokens", "prefixes")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    waiting_tokens: int
    running_requests: int
    free_pages: int
    total_pages: int
    max_queued_tokens: int
    prefixes: PrefixDigest
    def __init__(self, instance_id: _Optional[str] = ..., waiting_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., max_queued_tokens: _Optional[int] = ..., prefixes: _Optional[_Union[PrefixDigest, _Mapping]] = ...) -> None: ...
