"""One engine step as data: what the scheduler decided (`StepPlan`) and what the model runner
read back (`StepResult`).

The runner keeps a table of rows indexed by a small integer, the row's *slot*, from the step it
joins until the step it leaves. A plan names rows only by slot and carries only what changed:
rows that join (with what their sampling needs and their LoRA adapter's slot), rows that leave,
adapters no longer used (`unload`), the block tables that changed,
the pool's `BlockUpdate`, the step's prefill chunks, and the slots that take a decode step (or
a verification of drafted tokens). Under tensor parallel, rank 0 sends each plan as it is to the
other ranks, whose runners replay it.

Rows with a response format sample under a token mask (service.common.grammar): the plan
carries the masks known when it is made (prefills that sample, verifications); a decode step's
masks follow once the step before it is read (`RowMasks`, ModelRunner.sample).

A result holds the step's sampled tokens (and logprobs) as arrays, in plan order: first each
prefill forward's sampled rows, then the decode or verification rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np

from service.core.kv.block_pool import BlockUpdate
from service.protocol import SamplingParams


class RowJoin(msgspec.Struct, array_like=True):
    """A row entering the runner's table (admitted, or resumed after a preemption)."""

    slot: int
    seq_id: str
    params: SamplingParams
    prompt: list[int]  # the request's prompt (repetition penalties read it)
    num_cached: int  # positions stored already (an adopted prefix): prefill starts there
    want_logprobs: bool = False
    top_logprobs: int = 0
    resume: bool = False  # back after a preemption: keeps its sampler state
    constrained: bool = False  # a response format: its logits take a token mask each step
    adapter: int = 0  # its LoRA adapter's slot (0: the base model)


class RowLeave(msgspec.Struct, array_like=True):
    slot: int
    final: bool  # False: preempted, it comes back later (its sampler state is kept)


class Chunk(msgspec.Struct, array_like=True):
    """Prompt tokens of one row for one prefill forward."""

    slot: int
    tokens: list[int]
    sample: bool  # the prompt's last chunk: sample the first token


class Draft(msgspec.Struct, array_like=True):
    slot: int
    tokens: list[int]  # drafted tokens after the row's last one (empty: a plain decode step)


class RowMasks(msgspec.Struct, array_like=True):
    """Token bitmasks (structured output) for some sampling positions: `data` holds
    len(slots) rows of `words` little-endian int32 words, row i the mask of slot slots[i]'s
    position (bit t of a row allows token t). A verification row's positions (its last token,
    then each drafted token) take consecutive rows."""

    slots: list[int]
    words: int
    data: bytes

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<i4").reshape(len(self.slots), self.words)


class StepPlan(msgspec.Struct):
    step: int
    joins: list[RowJoin] = msgspec.field(default_factory=list)
    leaves: list[RowLeave] = msgspec.field(default_factory=list)
    forget: list[str] = msgspec.field(default_factory=list)  # preempted rows that end waiting
    # Rows whose block table changed: (slot, the whole table).
    tables: list[tuple[int, list[int]]] = msgspec.field(default_factory=list)
    capacity: int = 0  # BlockUpdate: blocks the K/V arrays must cover
    copies: list[tuple[int, int]] = msgspec.field(default_factory=list)  # BlockUpdate copies
    prefill: list[list[Chunk]] = msgspec.field(default_factory=list)  # one list per forward
    decode: list[int] = msgspec.field(default_factory=list)  # slots feeding their last token
    verify: list[Draft] = msgspec.field(default_factory=list)  # instead of `decode`
    # Masks known when the plan is made: constrained rows whose prefill samples, and the
    # positions of constrained verification rows. A decode step's masks depend on the tokens
    # of the step before, which may still run: they come later (ModelRunner.sample).
    masks: RowMasks | None = None
    # LoRA adapter slots to clear, after the leaves: their adapters were unloaded and no row
    # uses them any more.
    unload: list[int] = msgspec.field(default_factory=list)

    @property
    def update(self) -> BlockUpdate:
        return BlockUpdate(self.capacity, tuple(self.copies))

    @property
    def has_forward(self) -> bool:
        return bool(self.prefill or self.decode or self.verify)

    @property
    def changes(self) -> bool:
        return bool(
            self.joins or self.leaves or self.forget or self.tables or self.copies or self.unload
        )


@dataclass
class StepResult:
    """What one step produced. `slots[i]` sampled `tokens[i]`; a verification row emits
    `counts[i]` tokens (consecutive in `tokens`), every other row one. `errors`: rows whose
    evaluation failed (slot -> message): they produced nothing."""

    step: int
    slots: np.ndarray  # int32 [S]
    tokens: np.ndarray  # int32 [sum(counts)]
    counts: np.ndarray | None = None  # int32 [S]; None: one token each
    logprobs: np.ndarray | None = None  # float32, per token, when a row asked
    top_ids: np.ndarray | None = None  # int32 [tokens, K]
    top_logprobs: np.ndarray | None = None  # float32 [tokens, K]
    drafted: np.ndarray | None = None  # int32 [S]: verification rows' drafted tokens
    errors: dict[int, str] = field(default_factory=dict)
    prefill_seconds: list[float] = field(default_factory=list)  # per prefill forward, measured
    prefill_rows: int = 0  # the leading entries that prefill forwards sampled
    decoded: bool = False  # the plan's decode or verification forward is in it

    @classmethod
    def empty(cls, step: int) -> StepResult:
        return cls(step, np.zeros(0, np.int32), np.zeros(0, np.int32))

    @classmethod
    def merge(cls, step: int, parts: list[StepResult]) -> StepResult:
        """One result from several forwards' (in order)."""
        parts = [p for p in parts if len(p.slots) or p.errors or p.prefill_seconds]
        if not parts:
            return cls.empty(step)
        if len(parts) == 1:
            only = parts[0]
            only.step = step
            return only
        result = cls(
            step,
            np.concatenate([p.slots for p in parts]).astype(np.int32),
            np.concatenate([p.tokens for p in parts]).astype(np.int32),
        )
        if any(p.counts is not None for p in parts):
            result.counts = np.concatenate(
                [
                    p.counts if p.counts is not None else np.ones(len(p.slots), np.int32)
                    for p in parts
                ]
            )
            result.drafted = np.concatenate(
                [
                    p.drafted if p.drafted is not None else np.zeros(len(p.slots), np.int32)
                    for p in parts
                ]
            )
        if any(p.logprobs is not None for p in parts):
            result.logprobs = np.concatenate(
                [
                    p.logprobs if p.logprobs is not None else np.zeros(len(p.tokens), np.float32)
                    for p in parts
                ]
            )
            k = max((p.top_ids.shape[1] for p in parts if p.top_ids is not None), default=0)
            if k:
                result.top_ids = np.concatenate(
                    [_top(p.top_ids, len(p.tokens), k, np.int32) for p in parts]
                )
                result.top_logprobs = np.concatenate(
                    [_top(p.top_logprobs, len(p.tokens), k, np.float32) for p in parts]
                )
        for p in parts:
            result.errors.update(p.errors)
            result.prefill_seconds.extend(p.prefill_seconds)
        return result


def _top(values: np.ndarray | None, n: int, k: int, dtype: type) -> np.ndarray:
    """A top-logprobs block widened to k columns (zeros where a forward asked for fewer)."""
    out = np.zeros((n, k), dtype)
    if values is not None:
        out[:, : values.shape[1]] = values
    return out
