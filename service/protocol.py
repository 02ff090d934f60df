"""What crosses the process boundary: requests as the front ends validated them, what each
engine step produced for them, and the messages the gRPC front ends and the engine core send
each other over ZeroMQ, in msgpack. No MLX and no gRPC here: both sides import it.

Sockets (ipc:// paths in the server's run directory):
- The core binds a ROUTER (`core.sock`); each front end connects a DEALER to it and sends its
  requests, aborts and queries there; the core answers on the same socket (ready, rejections,
  stats, health).
- Each front end binds a PULL (`frontend-N.sock`); the core's engine thread connects a PUSH to
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


class StepOutput(msgspec.Struct, array_like=True):
    """What one scheduler tick produced for one request: its new tokens (and their logprobs),
    its lifecycle events for telemetry, and on the last one how it ended. Token ids only: the
    front ends detokenize."""

    rid: int
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    # (name, attributes): queued, admitted, resumed, prefill_chunk, first_token, preempted,
    # finished.
    events: list[tuple[str, dict[str, int | float | str]]] = msgspec.field(default_factory=list)
    final: Final | None = None
    drafted: int = 0  # prompt-lookup tokens verified this tick
    accepted: int = 0  # of them, accepted

    @property
    def finished(self) -> bool:
        return self.final is not None


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


ToCore = Hello | Add | Abort | StatsQuery

# -- core -> front end (ROUTER replies) ----------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    model_info: bytes  # a serialized GetModelInfoResponse
    tokenizer_dir: str  # the model's tokenizer, saved for the front ends to load
    eos_token_ids: list[int]
    slot_context: int
    capacity_tokens: int | None  # the most tokens one sequence could ever hold (None: no cap)
    pid: int = 0  # the core's process id (its process metrics)
    prompt_cache: bool = True  # requests may adopt and leave cached prompt prefixes


class LoadFailed(msgspec.Struct, tag=True):
    message: str


class Rejected(msgspec.Struct, tag=True):
    rid: int
    message: str  # the waiting queue is full: RESOURCE_EXHAUSTED


class StatsReply(msgspec.Struct, tag=True):
    qid: int
    stats: bytes  # a serialized CacheStatsResponse


class Health(msgspec.Struct, tag=True):
    healthy: bool  # several engine steps in a row failed (False), or one succeeded again


FromCore = Ready | LoadFailed | Rejected | StatsReply | Health

# -- core -> front end (one message per engine step) -------------------------------------------


class Outputs(msgspec.Struct, tag=True):
    items: list[StepOutput]  # every request of the front end that produced something


_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)
_outputs = msgspec.msgpack.Decoder(Outputs)
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


def decode_outputs(data: bytes) -> Outputs:
    return _outputs.decode(data)


def core_address(run_dir: Path) -> str:
    return f"ipc://{run_dir / 'core.sock'}"


def frontend_address(run_dir: Path, index: int) -> str:
    return f"ipc://{run_dir / f'frontend-{index}.sock'}"
