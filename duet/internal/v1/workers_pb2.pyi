from duet.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatsRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_kv_blocks", "num_free_blocks", "num_running", "num_waiting", "num_waiting_tokens", "num_reservations", "integrity_error", "prefix_query_tokens", "prefix_hit_tokens", "num_kv_events_published", "num_kv_events_dropped", "num_index_resyncs", "kv_event_lag_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_EVENTS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEX_RESYNCS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_LAG_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_kv_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_reservations: int
    integrity_error: str
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_kv_events_published: int
    num_kv_events_dropped: int
    num_index_resyncs: int
    kv_event_lag_s: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_reservations: _Optional[int] = ..., integrity_error: _Optional[str] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., num_kv_events_published: _Optional[int] = ..., num_kv_events_dropped: _Optional[int] = ..., num_index_resyncs: _Optional[int] = ..., kv_event_lag_s: _Optional[float] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("kv_address", "reservation_id", "kv_addresses", "num_cached_blocks")
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kv_address: str
    reservation_id: int
    kv_addresses: _containers.RepeatedScalarFieldContainer[str]
    num_cached_blocks: int
    def __init__(self, kv_address: _Optional[str] = ..., reservation_id: _Optional[int] = ..., kv_addresses: _Optional[_Iterable[str]] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "target", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    cache_salt: str
    target: KVTarget
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "logprob", "cached_tokens", "finish_reason", "stop_token_id", "queue_s", "prefill_s", "transfer_s", "kv_bytes", "kv_transferred_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    logprob: _generation_pb2.TokenLogprob
    cached_tokens: int
    finish_reason: str
    stop_token_id: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    kv_bytes: int
    kv_transferred_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_transferred_tokens: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "ttl_s", "prompt_token_ids", "sampling", "cache_salt", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ttl_s: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    cache_salt: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "kv_address", "num_blocks", "kv_addresses", "num_cached_blocks")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    kv_address: str
    num_blocks: int
    kv_addresses: _containers.RepeatedScalarFieldContainer[str]
    num_cached_blocks: int
    def __init__(self, reservation_id: _Optional[int] = ..., kv_address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., kv_addresses: _Optional[_Iterable[str]] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation_id", "request_id")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    request_id: str
    def __init__(self, reservation_id: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("reservation_id", "first_token_id", "prefill_locally")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    first_token_id: int
    prefill_locally: bool
    def __init__(self, reservation_id: _Optional[int] = ..., first_token_id: _Optional[int] = ..., prefill_locally: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    finish_reason: str
    stop_token_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...
