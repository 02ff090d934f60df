"""Request and sequence state: what the scheduler tracks for each admitted request."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.engine.sampler import SamplingParams


class SequenceStatus(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


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


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepOutput:
    """What one scheduler tick produced for one request (a stream message)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


OutputSink = Callable[[list[StepOutput]], None]


@dataclass(eq=False)
class Sequence:
    """One request moving through Queued → Prefilling → Decoding → Finished."""

    request: GenerationRequest
    sink: OutputSink
    arrival: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.QUEUED
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens (prompt + generated) whose K/V are in the cache
    cached_tokens: int = 0  # prompt tokens adopted from the prefix cache
    engine_seq: Any = None
    detokenizer: Any = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    finish_reason: FinishReason | None = None
    cancel_requested: bool = False
    preemptions: int = 0
    arrival_order: int = 0
    plan: Any = None  # PrefillPlan of the current admission
    parked_ticks: int = 0  # consecutive ticks this prefill was passed over
    sampler_state: Any = None  # kept across preemption: seeded draws continue unchanged
    telemetry: Any = None  # per-request span / metrics state (service/telemetry), or None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """What a (re-)prefill must put into the KV cache: the prompt plus tokens so far."""
        return [*self.request.prompt_token_ids, *self.output_token_ids]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def timing(self, now: float) -> tuple[float, float, float]:
        queue = (self.admitted_at or now) - self.arrival
        ttft = (self.first_token_at or now) - self.arrival
        return queue, ttft, now - self.arrival
