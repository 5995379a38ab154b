from dsmesh.v1 import generation_pb2 as _generation_pb2
from dsmesh.v1 import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling", "handoff_timeout_ms", "resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    handoff_timeout_ms: int
    resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., handoff_timeout_ms: _Optional[int] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "logprobs", "prompt_logprobs", "spec")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    spec: _generation_pb2.SpecUsage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., spec: _Optional[_Union[_generation_pb2.SpecUsage, _Mapping]] = ...) -> None: ...

class DecodeLoad(_message.Message):
    __slots__ = ("instance_id", "free_pages", "total_pages", "running_requests", "waiting_handoffs", "page_size", "max_running_requests", "prefixes")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    free_pages: int
    total_pages: int
    running_requests: int
    waiting_handoffs: int
    page_size: int
    max_running_requests: int
    prefixes: _prefill_pb2.PrefixDigest
    def __init__(self, instance_id: _Optional[str] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_handoffs: _Optional[int] = ..., page_size: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., prefixes: _Optional[_Union[_prefill_pb2.PrefixDigest, _Mapping]] = ...) -> None: ...
