from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logprobs", "stop", "stop_token_ids", "max_tokens", "min_tokens", "ignore_eos", "skip_special_tokens", "prompt_logprobs", "logit_bias", "include_stop_str_in_output", "priority", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    skip_special_tokens: bool
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    priority: int
    structured_output: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., priority: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Resumed(_message.Message):
    __slots__ = ("num_output_tokens", "num_emitted_chars")
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_CHARS_FIELD_NUMBER: _ClassVar[int]
    num_output_tokens: int
    num_emitted_chars: int
    def __init__(self, num_output_tokens: _Optional[int] = ..., num_emitted_chars: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "stop_reason", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    stop_reason: str
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class LayoutFingerprint(_message.Message):
    __slots__ = ("model_fingerprint", "dtype", "block_size", "groups", "state", "state_blocks")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: str
    block_size: int
    groups: _containers.RepeatedCompositeFieldContainer[PagedGroup]
    state: _containers.RepeatedCompositeFieldContainer[StateRing]
    state_blocks: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[PagedGroup, _Mapping]]] = ..., state: _Optional[_Iterable[_Union[StateRing, _Mapping]]] = ..., state_blocks: _Optional[int] = ...) -> None: ...

class PagedGroup(_message.Message):
    __slots__ = ("name", "num_layers", "tokens_per_entry", "dim", "packed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ENTRY_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    tokens_per_entry: int
    dim: int
    packed: bool
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., tokens_per_entry: _Optional[int] = ..., dim: _Optional[int] = ..., packed: _Optional[bool] = ...) -> None: ...

class StateRing(_message.Message):
    __slots__ = ("name", "num_layers", "rows", "dim", "at_boundary", "token_ids", "packed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    rows: int
    dim: int
    at_boundary: bool
    token_ids: bool
    packed: bool
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., at_boundary: _Optional[bool] = ..., token_ids: _Optional[bool] = ..., packed: _Optional[bool] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("transfer_id", "worker_id", "host", "port", "num_tokens", "block_size", "num_blocks", "layout", "expires_at", "transport")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    worker_id: str
    host: str
    port: int
    num_tokens: int
    block_size: int
    num_blocks: int
    layout: LayoutFingerprint
    expires_at: float
    transport: str
    def __init__(self, transfer_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layout: _Optional[_Union[LayoutFingerprint, _Mapping]] = ..., expires_at: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_address", "kv_transport", "model", "model_fingerprint", "max_model_len", "block_size", "num_kv_blocks", "metrics_port", "dep_group", "dep_rank", "pid", "started_at")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    DEP_GROUP_FIELD_NUMBER: _ClassVar[int]
    DEP_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    kv_address: str
    kv_transport: str
    model: str
    model_fingerprint: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    metrics_port: int
    dep_group: str
    dep_rank: int
    pid: int
    started_at: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., kv_address: _Optional[str] = ..., kv_transport: _Optional[str] = ..., model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., metrics_port: _Optional[int] = ..., dep_group: _Optional[str] = ..., dep_rank: _Optional[int] = ..., pid: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("running", "waiting", "queued_prefill_tokens", "free_kv_blocks", "total_kv_blocks", "cached_kv_blocks", "step_time_s", "updated_at")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    queued_prefill_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    cached_kv_blocks: int
    step_time_s: float
    updated_at: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., cached_kv_blocks: _Optional[int] = ..., step_time_s: _Optional[float] = ..., updated_at: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
