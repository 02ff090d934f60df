"""What the scheduler tracks for each request."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

from service.common.grammar import Compiled, Matcher
from service.core.kv.block_pool import SequenceBlocks
from service.core.scheduler.adapters import AdapterEntry
from service.core.scheduler.prefill_plan import PrefillPlan
from service.core.scheduler.prompt_lookup import DraftPacing, NgramIndex
from service.protocol import FinishReason, GenerationRequest, Outputs


class SequenceStatus(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class OutputSink(Protocol):
    """Where a request's outputs go: one `deliver` call per tick with the outputs of every
    request that shares the sink (one message to a front end, one wake-up)."""

    batch_key: Hashable

    def deliver(self, outputs: Outputs) -> None: ...


@dataclass(eq=False)
class Request:
    """One request as the scheduler tracks it: Queued → Prefilling → Decoding → Finished (and
    back to Queued when preempted)."""

    request: GenerationRequest
    sink: OutputSink
    rid: int = 0  # the front end's handle: what its outputs are routed by
    arrival: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.QUEUED
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens (prompt + generated) whose K/V are in the cache
    in_flight: int = 0  # decode tokens submitted and not yet read
    cached_tokens: int = 0  # prompt tokens adopted from the prefix cache
    slot: int = -1  # its row in the model runner's table while running
    blocks: SequenceBlocks | None = None  # its KV block table (the scheduler's KVManager)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finish_reason: FinishReason | None = None
    cancel_requested: bool = False
    preemptions: int = 0
    arrival_order: int = 0
    plan: PrefillPlan | None = None  # the prefill of the current admission
    parked_ticks: int = 0  # consecutive ticks this prefill was passed over
    lookup: NgramIndex | None = None  # prompt-lookup n-gram index (speculative decoding)
    pacing: DraftPacing | None = None  # how much it drafts (speculative decoding)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Structured output: the compiled response format (set before the request is queued) and
    # the row's grammar state, made at its first admission and kept while it is preempted.
    grammar: Compiled | None = None
    matcher: Matcher | None = None
    adapter: AdapterEntry | None = None  # its LoRA adapter, held from arrival to the end

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seq_id(self) -> str:
        """Unique among the scheduler's sequences (a caller's request_id may be reused)."""
        return f"{self.request.request_id}#{self.arrival_order}"

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
