"""What crosses the process boundary: requests as the front ends validated them, what each
engine step produced for them, and the messages the gRPC front ends and the engine core send
each other over ZeroMQ, in msgpack. No MLX and no gRPC here: both sides import it.

Sockets (ipc:// paths in the server's run directory):
- The core binds a ROUTER (`core.sock`); each front end connects a DEALER to it and sends its
  requests, aborts and queries there; the core answers on the same socket (ready, rejections,
  stats, health).
- Each front end binds a PULL (`frontend-N.sock`); the core's loop thread connects a PUSH to
  it and sends one `Outputs` message per engine step: every row of that front end that
  produced something (new tokens and logprobs, lifecycle events, the final summary), never one
  message per token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import msgspec

# -- requests and what they produce ----------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def fused_key(self) -> tuple[float, float, int, float]:
        """Rows with equal keys are sampled by one fused draw."""
        if self.greedy:
            return (0.0, 1.0, 0, 0.0)
        return (self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


FORMAT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's output must be (structured output): `kind` is one of FORMAT_KINDS;
    `text` the JSON Schema, regular expression or grammar; `options` the choice's strings."""

    kind: str
    text: str = ""
    options: tuple[str, ...] = ()


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, independent of gRPC."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    cache_prompt: bool = True
    response_format: ResponseFormat | None = None
    adapter: str = ""  # a served LoRA adapter's name; empty: the base model


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Final(msgspec.Struct, array_like=True):
    """How a request ended, with its usage and timing (the last output of a request)."""

    reason: str  # a FinishReason value
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    drafted_tokens: int = 0  # prompt-lookup tokens proposed for this request
    accepted_tokens: int = 0  # of them, accepted by the model

    @property
    def finish_reason(self) -> FinishReason:
        return FinishReason(self.reason)


Event = tuple[str, dict[str, int | float | str]]  # (name, attributes)


class Outputs(msgspec.Struct, tag=True):
    """One engine-core tick's outputs for the requests of one front end, by the front end's
    request handles (rid). Token ids only: the front ends detokenize.

    `tokens[i]` is rid `rids[i]`'s new token, or with `counts` set, `counts[i]` consecutive
    tokens are. The rest is sparse: logprobs for the rows that asked; lifecycle events (queued,
    admitted, resumed, prefill_chunk, first_token, preempted, finished); drafted and accepted
    prompt-lookup tokens; and on a request's last tick how it ended."""

    rids: list[int] = msgspec.field(default_factory=list)
    tokens: list[int] = msgspec.field(default_factory=list)
    counts: list[int] | None = None
    logprobs: dict[int, list[TokenLogprob]] = msgspec.field(default_factory=dict)
    events: dict[int, list[Event]] = msgspec.field(default_factory=dict)
    drafts: dict[int, tuple[int, int]] = msgspec.field(default_factory=dict)  # (drafted, accepted)
    finals: dict[int, Final] = msgspec.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rids or self.events or self.finals)


class SlotView(msgspec.Struct, array_like=True):
    """One running request in a stats reply."""

    request_id: str
    state: str  # "prefilling" or "decoding"
    generated_tokens: int
    context_tokens: int  # tokens in its KV cache
    priority: int
    adapter: str = ""  # its LoRA adapter ("": the base model)


# Upper bounds (seconds) of the mask-time histograms the core keeps (GrammarCounters).
MASK_SECONDS_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
)  # fmt: skip


class GrammarCounters(msgspec.Struct):
    """The engine core's structured-output work since it started (cumulative: Prometheus reads
    them at scrape time). Mask times are the wall time of filling a step's token bitmasks;
    a row-step's share is the step's time over its constrained rows. `*_buckets[i]` counts the
    observations at most MASK_SECONDS_BUCKETS[i] (not cumulative; the last entry: above all)."""

    compiles: int = 0  # formats compiled (cache misses), refusals included
    cache_hits: int = 0
    refusals: int = 0
    compile_seconds: float = 0.0
    mask_steps: int = 0
    mask_rows: int = 0
    mask_seconds: float = 0.0
    mask_step_buckets: list[int] = msgspec.field(default_factory=list)
    mask_row_buckets: list[int] = msgspec.field(default_factory=list)


class StepCounters(msgspec.Struct):
    """The engine core's steps with a forward since it started, by how each was planned
    (cumulative, for the metrics): while the step before it ran (overlapped), or after that
    step was read (serial: an admission, a prefill, a preemption, a verification or a
    cancellation waits for it)."""

    overlapped: int = 0
    serial: int = 0


class CacheCounters(msgspec.Struct):
    """The engine core's KV cache and batch state at one moment (what CacheStats answers; the
    front end makes the protobuf). Field names are CacheStatsResponse's."""

    storage_backend: str = ""
    block_size: int = 0
    total_blocks: int = 0
    allocated_blocks: int = 0
    active_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    reserved_bytes: int = 0
    used_bytes: int = 0
    budget_bytes: int = 0
    capacity_bytes: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    active_sequences: int = 0
    queued_requests: int = 0
    total_completed: int = 0
    total_failed: int = 0
    preemptions: int = 0
    slot_context_tokens: int = 0
    max_batch_size: int = 0
    slots: list[SlotView] = msgspec.field(default_factory=list)
    grammar: GrammarCounters = msgspec.field(default_factory=GrammarCounters)
    steps: StepCounters = msgspec.field(default_factory=StepCounters)


class Quantization(msgspec.Struct):
    mode: str = ""
    bits: int = 0
    group_size: int = 0
    overrides: int = 0
    dequantized: bool = False  # served as float weights (the CPU)


class Speculation(msgspec.Struct):
    draft_kind: str = "none"
    num_draft_tokens: int = 0
    max_batch: int = 0
    min_ngram: int = 0
    max_ngram: int = 0


class StructuredOutputInfo(msgspec.Struct):
    """The engine behind response_format (GetModelInfo's structured_output); empty when the
    model's tokenizer cannot drive it."""

    engine: str = ""
    engine_version: str = ""
    kinds: list[str] = msgspec.field(default_factory=list)
    grammar_syntax: str = ""
    max_compile_ms: int = 0


class AdapterDescription(msgspec.Struct):
    """A served LoRA adapter (GetModelInfo's AdapterInfo; field names are its)."""

    name: str
    path: str = ""
    fine_tune_type: str = "lora"  # "lora" or "dora"
    rank: int = 0
    scale: float = 0.0
    # What the adapter's config targets: module names inside a layer ("self_attn.q_proj") or
    # of the whole model ("lm_head").
    target_modules: list[str] = msgspec.field(default_factory=list)
    num_layers: int = 0  # layers it adapts (of the model's)
    memory_bytes: int = 0  # its weights as the server holds them


class ModelInfo(msgspec.Struct):
    """The served model, as GetModelInfo describes it (field names are its response's)."""

    model_id: str = ""
    architecture: str = ""
    vocab_size: int = 0
    num_layers: int = 0
    dtype: str = ""
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    decode_path: str = ""
    slot_context_tokens: int = 0
    max_batch_size: int = 0
    storage_backend: str = ""
    family: str = ""
    quantization: Quantization = msgspec.field(default_factory=Quantization)
    cache_layers: str = ""
    tensor_parallel: int = 1
    speculation: Speculation = msgspec.field(default_factory=Speculation)
    structured_output: StructuredOutputInfo = msgspec.field(default_factory=StructuredOutputInfo)
    adapters: list[AdapterDescription] = msgspec.field(default_factory=list)


# -- front end -> core -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    frontend: str
    outputs: str  # the front end's PULL address


class Add(msgspec.Struct, tag=True):
    rid: int  # the front end's handle of the request (never the caller's request_id)
    request: GenerationRequest
    trace: tuple[str, str] | None = None  # (trace_id, span_id): the core's log lines carry them


class Abort(msgspec.Struct, tag=True):
    rid: int


class StatsQuery(msgspec.Struct, tag=True):
    qid: int


class LoadAdapter(msgspec.Struct, tag=True):
    qid: int
    name: str
    path: str  # on the engine core's file system


class UnloadAdapter(msgspec.Struct, tag=True):
    qid: int
    name: str


ToCore = Hello | Add | Abort | StatsQuery | LoadAdapter | UnloadAdapter

# -- core -> front end (ROUTER replies) ----------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    model_info: ModelInfo
    tokenizer_dir: str  # the model's tokenizer, saved for the front ends to load
    eos_token_ids: list[int]
    slot_context: int
    capacity_tokens: int | None  # the most tokens one sequence could ever hold (None: no cap)
    pid: int = 0  # the core's process id (its process metrics)
    prompt_cache: bool = True  # requests may adopt and leave cached prompt prefixes


class TokenizerSaved(msgspec.Struct, tag=True):
    """The model's tokenizer is saved (before Ready, while the weights load): the front ends
    load it meanwhile. Ready names the same directory."""

    tokenizer_dir: str


class LoadFailed(msgspec.Struct, tag=True):
    message: str


class Rejected(msgspec.Struct, tag=True):
    rid: int
    message: str
    # queue_full: the waiting queue is full (RESOURCE_EXHAUSTED); invalid_format: the grammar
    # engine refused the request's response_format (INVALID_ARGUMENT on `field`); adapter: the
    # request's adapter is not (or no longer) served (NOT_FOUND).
    reason: str = "queue_full"
    field: str = ""
    code: str = ""  # invalid_format: the engine's refusal code (service.common.grammar)


class StatsReply(msgspec.Struct, tag=True):
    qid: int
    stats: CacheCounters


class Health(msgspec.Struct, tag=True):
    healthy: bool  # several engine steps in a row failed (False), or one succeeded again


class AdapterReply(msgspec.Struct, tag=True):
    """How a LoadAdapter or UnloadAdapter went."""

    qid: int
    adapter: AdapterDescription | None = None  # loaded
    pending_requests: int = 0  # unloaded once these requests have ended
    error: str | None = None
    reason: str = ""  # with an error: "exists", "not_found" or "refused"


class AdaptersChanged(msgspec.Struct, tag=True):
    """The adapters requests may use now (to every front end, after a load or an unload)."""

    adapters: list[AdapterDescription]


FromCore = (
    Ready
    | TokenizerSaved
    | LoadFailed
    | Rejected
    | StatsReply
    | Health
    | AdapterReply
    | AdaptersChanged
)

_to_core = msgspec.msgpack.Decoder(list[ToCore])
_from_core = msgspec.msgpack.Decoder(FromCore)
_outputs = msgspec.msgpack.Decoder(Outputs)
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def encode_to_core(messages: list[ToCore]) -> bytes:
    """A front end's messages of one event-loop iteration, in order: one ZeroMQ message."""
    return _encoder.encode(messages)


def decode_to_core(data: bytes) -> list[ToCore]:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


def decode_outputs(data: bytes) -> Outputs:
    return _outputs.decode(data)


def core_address(run_dir: Path) -> str:
    return f"ipc://{run_dir / 'core.sock'}"


def frontend_address(run_dir: Path, index: int) -> str:
    return f"ipc://{run_dir / f'frontend-{index}.sock'}"
