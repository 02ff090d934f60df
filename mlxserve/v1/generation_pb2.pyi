from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATE_UNSPECIFIED: _ClassVar[SlotState]
    SLOT_STATE_PREFILLING: _ClassVar[SlotState]
    SLOT_STATE_DECODING: _ClassVar[SlotState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
SLOT_STATE_UNSPECIFIED: SlotState
SLOT_STATE_PREFILLING: SlotState
SLOT_STATE_DECODING: SlotState

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIdsInput(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logit_bias")
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
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: ChoiceList
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "stopping", "priority", "logprobs", "top_logprobs", "cache_prompt", "response_format", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIdsInput
    chat: ChatInput
    sampling: SamplingParams
    stopping: StoppingCriteria
    priority: int
    logprobs: bool
    top_logprobs: int
    cache_prompt: bool
    response_format: ResponseFormat
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIdsInput, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., priority: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., cache_prompt: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class StreamGenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "stopping", "priority", "logprobs", "top_logprobs", "cache_prompt", "response_format", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIdsInput
    chat: ChatInput
    sampling: SamplingParams
    stopping: StoppingCriteria
    priority: int
    logprobs: bool
    top_logprobs: int
    cache_prompt: bool
    response_format: ResponseFormat
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIdsInput, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., priority: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., cache_prompt: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "drafted_tokens", "accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_seconds", "time_to_first_token_seconds", "total_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "text", "bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    text: str
    bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., bytes: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top_logprobs", "text", "bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    text: str
    bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., text: _Optional[str] = ..., bytes: _Optional[bytes] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "timing", "logprobs", "stop_string")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_string: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_string: _Optional[str] = ...) -> None: ...

class StreamGenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "timing", "logprobs", "stop_string")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_string: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_string: _Optional[str] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SlotInfo(_message.Message):
    __slots__ = ("request_id", "state", "generated_tokens", "context_tokens", "priority", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: SlotState
    generated_tokens: int
    context_tokens: int
    priority: int
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[SlotState, str]] = ..., generated_tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class CacheStatsResponse(_message.Message):
    __slots__ = ("storage_backend", "block_size", "total_blocks", "allocated_blocks", "active_blocks", "free_blocks", "cached_blocks", "reserved_bytes", "used_bytes", "budget_bytes", "prefix_lookups", "prefix_hits", "prefix_hit_tokens", "evictions", "active_sequences", "queued_requests", "total_completed", "preemptions", "slot_context_tokens", "max_batch_size", "slots", "total_failed", "capacity_bytes")
    STORAGE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FAILED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    storage_backend: str
    block_size: int
    total_blocks: int
    allocated_blocks: int
    active_blocks: int
    free_blocks: int
    cached_blocks: int
    reserved_bytes: int
    used_bytes: int
    budget_bytes: int
    prefix_lookups: int
    prefix_hits: int
    prefix_hit_tokens: int
    evictions: int
    active_sequences: int
    queued_requests: int
    total_completed: int
    preemptions: int
    slot_context_tokens: int
    max_batch_size: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    total_failed: int
    capacity_bytes: int
    def __init__(self, storage_backend: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., allocated_blocks: _Optional[int] = ..., active_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., prefix_lookups: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., active_sequences: _Optional[int] = ..., queued_requests: _Optional[int] = ..., total_completed: _Optional[int] = ..., preemptions: _Optional[int] = ..., slot_context_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ..., total_failed: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "num_layers", "dtype", "eos_token_ids", "decode_path", "slot_context_tokens", "max_batch_size", "storage_backend", "family", "quantization", "cache_layers", "tensor_parallel", "speculation", "structured_output", "adapters")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOT_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    num_layers: int
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_path: str
    slot_context_tokens: int
    max_batch_size: int
    storage_backend: str
    family: str
    quantization: Quantization
    cache_layers: str
    tensor_parallel: int
    speculation: Speculation
    structured_output: StructuredOutput
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., decode_path: _Optional[str] = ..., slot_context_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., storage_backend: _Optional[str] = ..., family: _Optional[str] = ..., quantization: _Optional[_Union[Quantization, _Mapping]] = ..., cache_layers: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("engine", "engine_version", "kinds", "grammar_syntax", "max_compile_ms")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_SYNTAX_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    engine_version: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    grammar_syntax: str
    max_compile_ms: int
    def __init__(self, engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ..., grammar_syntax: _Optional[str] = ..., max_compile_ms: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "fine_tune_type", "rank", "scale", "target_modules", "num_layers", "memory_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FINE_TUNE_TYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    fine_tune_type: str
    rank: int
    scale: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    num_layers: int
    memory_bytes: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., fine_tune_type: _Optional[str] = ..., rank: _Optional[int] = ..., scale: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., num_layers: _Optional[int] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("pending_requests",)
    PENDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    pending_requests: int
    def __init__(self, pending_requests: _Optional[int] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("draft_kind", "num_draft_tokens", "max_batch", "min_ngram", "max_ngram")
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MIN_NGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_FIELD_NUMBER: _ClassVar[int]
    draft_kind: str
    num_draft_tokens: int
    max_batch: int
    min_ngram: int
    max_ngram: int
    def __init__(self, draft_kind: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., max_batch: _Optional[int] = ..., min_ngram: _Optional[int] = ..., max_ngram: _Optional[int] = ...) -> None: ...

class Quantization(_message.Message):
    __slots__ = ("mode", "bits", "group_size", "overrides", "dequantized")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    DEQUANTIZED_FIELD_NUMBER: _ClassVar[int]
    mode: str
    bits: int
    group_size: int
    overrides: int
    dequantized: bool
    def __init__(self, mode: _Optional[str] = ..., bits: _Optional[int] = ..., group_size: _Optional[int] = ..., overrides: _Optional[int] = ..., dequantized: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "count_only")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    COUNT_ONLY_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatInput
    count_only: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., count_only: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens", "token_count", "fits_slot_context", "slot_context_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    FITS_SLOT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SLOT_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    token_count: int
    fits_slot_context: bool
    slot_context_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ..., token_count: _Optional[int] = ..., fits_slot_context: _Optional[bool] = ..., slot_context_tokens: _Optional[int] = ...) -> None: ...
