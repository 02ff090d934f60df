"""The constrained rows of the batch (structured output): each row's matcher by runner slot, the
token masks of its next sampling positions, and what each sampled token did to its grammar.

The scheduler owns it, as it owns the KV manager: it joins a row's matcher at admission (a
preempted request keeps its matcher while it waits, so it resumes where it stopped), advances
it over every token the row keeps, and asks here for the masks of each step's constrained
rows. A decode step's masks depend on the tokens of the step before: once that step's tokens
are taken (all the rows' grammars advanced in one parallel call), the fill starts on a thread of
its own (`begin`; llguidance fills a batch's masks on its threads with the GIL released) and the
core loop joins it when it samples the new step (`masks`). Drafted tokens are
validated before they are verified and only ever masked, never accepted unchecked (a refused
token leaves a matcher in an error state no rollback clears); the engine rolls its trial of
them back itself.

Pure Python, numpy and llguidance: no MLX.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from service.common.grammar import (
    Matcher,
    allocate_bitmask,
    consume_many,
    fill_masks,
    fill_masks_later,
    fill_masks_with_drafts,
    mask_words,
)
from service.core.scheduler.plan import Draft, RowMasks
from service.protocol import MASK_SECONDS_BUCKETS


class Verdict(enum.Enum):
    CONTINUE = "continue"
    END = "end"  # the document is complete: the request finishes with STOP
    REFUSED = "refused"  # the grammar refused a sampled token (a bug: it was masked)


@dataclass
class MaskStats:
    """Mask-filling time since start: per step (the batch's wall time) and per row-step (the
    step's time shared by its rows). `recent`: the last steps' (seconds, rows)."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0
    step_buckets: list[int] = field(default_factory=lambda: [0] * (len(MASK_SECONDS_BUCKETS) + 1))
    row_buckets: list[int] = field(default_factory=lambda: [0] * (len(MASK_SECONDS_BUCKETS) + 1))
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=8192))

    def observe(self, seconds: float, rows: int) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += seconds
        self.step_buckets[int(np.searchsorted(MASK_SECONDS_BUCKETS, seconds))] += 1
        self.row_buckets[int(np.searchsorted(MASK_SECONDS_BUCKETS, seconds / rows))] += rows
        self.recent.append((seconds, rows))


class Constraints:
    def __init__(
        self,
        max_rows: int,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """vocab_size: the model's logits width (the masks' width)."""
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self._matchers: list[Matcher | None] = [None] * max_rows
        self.active = np.zeros(max_rows, bool)  # per slot: the row is constrained
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._scratch = allocate_bitmask(max_rows, vocab_size)  # a decode step's masks
        self._clock = clock
        self.stats = MaskStats()
        # A decode step's fill started early (`begin`): its rows and the fill.
        self._pending: tuple[list[int], Future[float]] | None = None

    def join(self, slot: int, matcher: Matcher) -> None:
        self._matchers[slot] = matcher
        self.active[slot] = True

    def leave(self, slot: int) -> None:
        self._matchers[slot] = None
        self.active[slot] = False

    def matcher(self, slot: int) -> Matcher | None:
        return self._matchers[slot]

    def _of(self, slot: int) -> Matcher:
        m = self._matchers[slot]
        assert m is not None, f"slot {slot} has no matcher"
        return m

    # -- tokens ------------------------------------------------------------------------
    def accept(self, slot: int, token: int) -> tuple[Verdict, str]:
        """Advance the row's grammar over a token it keeps. EOS is only ever in the mask where
        the document may end, so it ends it; so does a token after which nothing but EOS
        could follow."""
        m = self._matchers[slot]
        if m is None:
            return Verdict.CONTINUE, ""
        if token in self._eos:
            return Verdict.END, ""
        if not m.accept(token):
            return Verdict.REFUSED, f"the grammar refused sampled token {token}: {m.error}"
        return (Verdict.END if m.is_terminated() else Verdict.CONTINUE), ""

    def accept_many(self, slots: np.ndarray, tokens: np.ndarray) -> list[tuple[int, Verdict, str]]:
        """`accept` for one token per row, the constrained rows' grammars advanced together:
        (index into slots, verdict, why) for each constrained row whose verdict is not
        CONTINUE."""
        mine = np.flatnonzero(self.active[slots])
        if not len(mine):
            return []
        out: list[tuple[int, Verdict, str]] = []
        index, matchers, ids = [], [], []
        for i in mine.tolist():
            token = int(tokens[i])
            if token in self._eos:
                out.append((i, Verdict.END, ""))
            else:
                index.append(i)
                matchers.append(self._of(int(slots[i])))
                ids.append(token)
        for i, m, token, ok in zip(index, matchers, ids, consume_many(matchers, ids)):
            if not ok:
                why = f"the grammar refused sampled token {token}: {m.error}"
                out.append((i, Verdict.REFUSED, why))
            elif m.is_terminated():
                out.append((i, Verdict.END, ""))
        return out

    def draft(self, slot: int, tokens: list[int]) -> list[int]:
        """The longest prefix of a row's drafted tokens its grammar allows (all of them for an
        unconstrained row): no position is verified that could not be kept."""
        m = self._matchers[slot]
        return tokens if m is None or not tokens else tokens[: m.validate(tokens)]

    # -- masks -------------------------------------------------------------------------
    def begin(self, slots: Sequence[int]) -> None:
        """Start filling the masks of the constrained rows among `slots` (their grammars have
        taken every token before this position) on a thread of their own, so that the
        engine's thread goes on with other work meanwhile; `masks` joins it."""
        self._join()
        mine = [int(s) for s in slots if self.active[s]]
        if mine:
            matchers = [self._of(s) for s in mine]
            fill = fill_masks_later(matchers, range(len(mine)), self._scratch, self._clock)
            self._pending = (mine, fill)

    def _join(self) -> tuple[list[int], float] | None:
        """Wait for the fill `begin` started, if any: (its rows, its seconds)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        rows, fill = pending
        return rows, fill.result()

    def masks(self, slots: Sequence[int]) -> RowMasks | None:
        """The masks of the next token of the constrained rows among `slots` (None: there are
        none), filled in one batch call on the engine's threads and timed: by the fill `begin`
        started for them (a row that ended since keeps its mask), else now."""
        begun = self._join()
        mine = [int(s) for s in slots if self.active[s]]
        if begun is not None and set(mine) <= set(begun[0]):
            mine, seconds = begun
        else:
            if not mine:
                return None
            started = self._clock()
            fill_masks([self._of(s) for s in mine], range(len(mine)), self._scratch)
            seconds = self._clock() - started
        self.stats.observe(seconds, len(mine))
        return RowMasks(mine, self.words, self._scratch[: len(mine)].tobytes())

    def plan_masks(self, sampling: Sequence[int], verify: Sequence[Draft]) -> RowMasks | None:
        """Masks known when a plan is made: the constrained rows among `sampling` (prefills that
        sample their first token) and every position of the constrained verification rows
        (their last token, then each drafted token; drafts validated already)."""
        prefill = [int(s) for s in sampling if self.active[s]]
        drafts = [d for d in verify if self.active[d.slot]]
        if not prefill and not drafts:
            return None
        total = len(prefill) + sum(len(d.tokens) + 1 for d in drafts)
        bitmask = allocate_bitmask(total, self.vocab_size)
        started = self._clock()
        fill_masks([self._of(s) for s in prefill], range(len(prefill)), bitmask)
        slots = list(prefill)
        if drafts:
            starts, at = [], len(prefill)
            for d in drafts:
                starts.append(at)
                slots += [d.slot] * (len(d.tokens) + 1)
                at += len(d.tokens) + 1
            fill_masks_with_drafts(
                [self._of(d.slot) for d in drafts],
                starts,
                [d.tokens for d in drafts],
                bitmask,
            )
        self.stats.observe(self._clock() - started, len(prefill) + len(drafts))
        return RowMasks(slots, self.words, bitmask.tobytes())
