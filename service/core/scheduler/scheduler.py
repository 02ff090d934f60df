"""The iteration-level scheduler: decides, tick by tick, what the engine runs.

Each tick: drain the inbox without blocking; end cancelled sequences; admit
waiting requests in priority order while the batch has room; run one prefill
pass (the next chunk of each admitted prompt, batched); run one batched decode
step for every decoding row; finish completed sequences at once. With nothing
running and nothing waiting, the loop blocks on the inbox (no busy loop).

Decode is pipelined: when a tick only decodes, step N+1 is built while step N runs
and dispatched as soon as N's tokens are read, or before they are read where the
engine's overlap_steps allows it (in-place pool writes on CUDA), so Python
bookkeeping overlaps device work.

The scheduler owns the KV cache manager (service.core.kv.block_pool), as vLLM v1's and nano-vllm's
schedulers do: it adopts cached prefixes and reserves a prompt's slots at admission, reserves
each decode step's slot (preempting when blocks run short), registers computed full blocks in
the prefix cache, gives back the slots of rejected draft tokens, and frees a sequence's blocks
when it finishes or is preempted. Each forward gets its rows' block tables and the manager's
pending `BlockUpdate`; the engine only runs forwards.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import structlog

from service.core.engine.engine import (
    DraftRow,
    ForwardEngine,
    PendingStep,
    RowResult,
    StepRow,
)
from service.core.kv.block_pool import KVManager
from service.core.scheduler.prefill_cost import PrefillCostModel, RowShape, RunningMedian
from service.core.scheduler.prefill_plan import PrefillPlan
from service.core.scheduler.prompt_lookup import NgramIndex
from service.core.scheduler.request import OutputSink, Request, SequenceStatus
from service.protocol import Final, FinishReason, StepOutput, TokenLogprob

log = structlog.get_logger(__name__)

ADAPTIVE_CHUNK_IDLE = 2048  # while nothing decodes: keeps a lone stream's TTFT low
ADAPTIVE_CHUNK_BUSY = 512  # while a decode batch runs, with the stall bound off (0)
# --max-prefill-stall-ms by default: this many median decode steps.
STALL_BOUND_STEPS = 4
# A stall-bounded chunk is never smaller (unless the prompt's rest is): the prefill always
# progresses. Two, not one: a one-token row would run as a decode-shaped step, which on the CPU
# path drops the decode batch's contiguous K/V copy.
MIN_PREFILL_CHUNK = 2


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue-depth."""


@dataclass
class SchedulerConfig:
    max_batch_size: int = 4
    max_queue_depth: int = 32
    slot_context: int = 8192
    prefill_chunk_size: int | None = None  # None = adaptive; 0 = no chunking
    # While rows decode, adaptive chunks are sized so that a decoding stream's inter-token gap
    # stays within this; None = STALL_BOUND_STEPS median decode steps; 0 = off (token counts).
    max_prefill_stall_ms: float | None = None
    max_batch_prefill: int = 4
    max_batch_prefill_tokens: int | None = None  # None = derived; 0 = no cap
    prefill_grant_interval: int = 16  # ticks a parked prefill yields before a guaranteed turn
    enable_preemption: bool = False
    preemption_policy: str = "longest-first"  # or "lowest-priority"
    kv_admission_watermark: float = 0.01  # free-block fraction kept while a batch decodes
    speculation: SpeculationConfig | None = None  # prompt-lookup drafting (None: off)


@dataclass(frozen=True)
class SpeculationConfig:
    """Prompt-lookup speculative decoding (--draft-kind prompt-lookup)."""

    num_draft_tokens: int = 4
    max_batch: int = 2  # rows decoding at most, for drafts to be verified
    min_ngram: int = 2
    max_ngram: int = 4
    max_context: int | None = 4608  # whole context at most (paged storage); None: no limit


@dataclass
class SchedulerStats:
    active_sequences: int = 0
    queued_requests: int = 0
    total_completed: int = 0  # finished with a result: stop, length or cancelled
    total_failed: int = 0  # finished with an error
    preemptions: int = 0


# Engine steps in a row whose every row failed before the engine counts as unhealthy (health
# NOT_SERVING) until a step succeeds again.
UNHEALTHY_AFTER_FAILED_STEPS = 3


@dataclass
class PrefillPass:
    """One prefill forward, as the stall bound planned and measured it."""

    request_ids: list[str]
    rows: list[RowShape]  # (new tokens, tokens already cached) per row
    seconds: float  # measured
    predicted_s: float | None = None  # None when the pass was not sized by the stall budget
    budget_s: float | None = None


@dataclass
class PrefillCosts:
    """The stall bound's bookkeeping: what prefill forwards and decode steps cost here."""

    model: PrefillCostModel = field(default_factory=PrefillCostModel)
    decode_step: RunningMedian = field(default_factory=RunningMedian)  # read to read, less passes
    passes: deque[PrefillPass] = field(default_factory=lambda: deque(maxlen=256))
    last_decode_read: float | None = None  # when the last decode step's tokens were read
    prefill_since_read: float = 0.0  # prefill seconds since then

    def decode_read(self, now: float) -> None:
        """A decode step's tokens were read: the time since the last read, less the prefill
        passes run in between, is one decode step as the streams see it. The median follows
        the steps as they slow down (longer contexts, other load on the machine)."""
        if self.last_decode_read is not None:
            self.decode_step.add(max(0.0, now - self.last_decode_read - self.prefill_since_read))
        self.last_decode_read = now
        self.prefill_since_read = 0.0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class _Cancel:
    """Cancel this sequence object, not "whatever now has its request_id": a client may reuse
    the id of a cancelled request before the scheduler has ended it."""

    def __init__(self, seq: Request) -> None:
        self.seq = seq


_STOP = object()


class Scheduler:
    def __init__(
        self,
        engine: ForwardEngine,
        config: SchedulerConfig,
        eos_token_ids: frozenset[int],
        *,
        kv: KVManager,
        on_health: Callable[[bool], None] | None = None,
        on_tick: Callable[[Scheduler, bool], None] | None = None,
        fatal_errors: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """kv: the KV manager of the engine's storage (a KVCacheManager for the paged pool,
        UnpagedKV for storage without blocks); on_health: told (on the scheduler thread) when
        the engine turns unhealthy or healthy again; on_tick: called after each tick, just before
        its outputs are delivered, on the scheduler thread, with whether any request's
        lifecycle changed in it: where stats are published."""
        self.engine = engine
        self.kv = kv
        self._clock = clock  # times forwards for the stall bound (a fake one in tests)
        self.costs = PrefillCosts()
        self._on_health = on_health
        self.healthy = True
        self._failed_steps = 0  # consecutive engine steps in which every row failed
        self._touched: list[Request] = []  # the sequences of the engine call under way
        self._on_tick = on_tick
        self._fatal_errors = fatal_errors  # an engine fault ends the loop (tensor parallel)
        self.config = config
        self._eos = eos_token_ids
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: list[tuple[int, int, Request]] = []  # heap: (-priority, order, seq)
        self._running: list[Request] = []
        self._inflight: PendingStep | None = None
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._pending_admissions = 0  # submitted, not yet admitted: the queue depth
        self._outbox: dict[Request, StepOutput] = {}  # this tick's output of each request
        self._thread: threading.Thread | None = None
        self.stats = SchedulerStats()

    # -- called from other threads ------------------------------------------------------
    def submit(self, seq: Request) -> None:
        """Queue a request; raises QueueFullError at once when the queue is full."""
        # Requests that free slots will take at the next tick are not waiting: a burst that
        # fits the batch is never refused.
        free_slots = max(0, self.config.max_batch_size - len(self._running))
        with self._lock:
            if self._pending_admissions >= self.config.max_queue_depth + free_slots:
                raise QueueFullError("Server is busy. Retry later.")
            self._pending_admissions += 1
        self._inbox.put(seq)

    def cancel(self, seq: Request) -> None:
        """End `seq` (queued or running) as cancelled at the next tick; no-op once finished."""
        self._inbox.put(_Cancel(seq))

    @property
    def queue_depth(self) -> int:
        return self._pending_admissions

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_forever, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> list[Request]:
        """The running requests (scheduler thread only: other threads read published stats)."""
        return self._running

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting or self._inflight is not None)

    # -- the loop -------------------------------------------------------------------
    def run_forever(self) -> None:
        try:
            self._loop()
        finally:
            # MLX wants each thread that used it to release its streams before exiting
            # (otherwise the process can abort at exit).
            mx.clear_streams()

    def _loop(self) -> None:
        while True:
            idle = not self._running and not self._waiting and self._inflight is None
            if not self._drain(block=idle):
                break
            try:
                self.tick()
            except Exception:
                if self._fatal_errors:
                    raise
                # A fault outside the engine's own per-row containment: end what it touched.
                touched = [s for s in self._touched if not s.is_finished] or list(self._running)
                log.exception("scheduler tick failed", request_ids=[s.request_id for s in touched])
                self._inflight = None
                for seq in touched:
                    self._finish(seq, FinishReason.ERROR, error="inference backend error")
                self._record_step(failed=True)
            self._touched = []
            self._flush_outbox()
        self._fail_all_on_stop()
        self._flush_outbox()

    def _drain(self, block: bool) -> bool:
        """Move inbox items into the scheduler; False when asked to stop."""
        try:
            item = self._inbox.get(block=block, timeout=None)
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            if isinstance(item, _Cancel):
                if not item.seq.is_finished:
                    item.seq.cancel_requested = True
            else:
                item.arrival_order = next(self._order)
                heapq.heappush(self._waiting, (-item.request.priority, item.arrival_order, item))
                self._event(item, "queued", queue_depth=len(self._waiting))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def tick(self) -> None:
        self._end_cancelled()
        if self.config.enable_preemption:
            self._preempt_for_waiting()
        self._admit()
        prefilling = [s for s in self._running if s.status is SequenceStatus.PREFILLING]
        if prefilling:
            self._complete_inflight()
            self._prefill(prefilling)
        self._decode_step()

    # -- actions ----------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        admitted = []
        while self._waiting and len(self._running) < self.config.max_batch_size:
            seq = self._waiting[0][2]
            if seq.cancel_requested:
                self._pop_waiting()
                self._finish(seq, FinishReason.CANCELLED)
                continue
            if not self._start_sequence(seq):
                break  # not enough KV blocks yet: the head of the queue waits for them
            self._pop_waiting()
            seq.status = SequenceStatus.PREFILLING
            seq.parked_ticks = 0
            first = seq.admitted_at is None
            seq.admitted_at = seq.admitted_at or time.monotonic()
            self._running.append(seq)
            admitted.append(seq)
            # The prefix-cache lookup of this admission, in tokens (what the metrics count).
            looked_up = seq.request.cache_prompt and self.kv.prefix_caching
            self._event(
                seq,
                "admitted" if first else "resumed",
                prefix_query_tokens=seq.plan.total_tokens if looked_up else 0,
                prefix_hit_tokens=seq.plan.cached_tokens,
            )
        return admitted

    def _pop_waiting(self) -> Request:
        _, _, seq = heapq.heappop(self._waiting)
        with self._lock:
            self._pending_admissions -= 1
        return seq

    def _start_sequence(self, seq: Request) -> bool:
        """Give a waiting sequence its KV blocks and engine state: adopt a cached prefix,
        reserve the rest of its prompt's slots now (prefill chunks then never run out), plan its
        prefill. While a batch decodes, --kv-admission-watermark of the pool stays free for the
        running rows. False (nothing held) if blocks are short."""
        req = seq.request
        tokens = seq.all_token_ids
        blocks = self.kv.new_sequence(cache_prefix=req.cache_prompt)
        keep_free = 0
        if any(s.status is SequenceStatus.DECODING for s in self._running):
            keep_free = int(self.config.kv_admission_watermark * self.kv.num_blocks)
        cached = self.kv.admit(blocks, tokens, req.cache_prompt, keep_free)
        if cached is None:
            return False
        engine_seq = self.engine.add_sequence(
            req.request_id,
            req.sampling,
            req.prompt_token_ids,
            want_logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            sampler=seq.sampler_state,
            num_cached=cached,
        )
        seq.engine_seq = engine_seq
        seq.blocks = blocks
        seq.sampler_state = engine_seq.sampler  # survives a preemption
        if seq.admitted_at is None:
            seq.cached_tokens = cached
        seq.plan = PrefillPlan(total_tokens=len(tokens), cached_tokens=cached)
        seq.num_computed = cached
        return True

    def _commit(self, seq: Request) -> None:
        """Offer the sequence's computed full blocks to the prefix cache."""
        if seq.request.cache_prompt:
            assert seq.blocks is not None
            computed = seq.all_token_ids[: seq.engine_seq.num_cached]
            self.kv.register_full_blocks(seq.blocks, computed)

    def chunk_size(self) -> int | None:
        """Tokens per prefill chunk now (at most, while the stall bound sizes the chunks);
        None means the whole remainder at once."""
        fixed = self.config.prefill_chunk_size
        if fixed is not None:
            return fixed or None
        decoding = any(s.status is SequenceStatus.DECODING for s in self._running)
        if not decoding or self.prefill_budget() is not None:
            return ADAPTIVE_CHUNK_IDLE
        return ADAPTIVE_CHUNK_BUSY

    def stall_bound(self) -> float | None:
        """Seconds a decoding stream may wait for its next token while prompts prefill; None
        when chunks are sized by token count: a fixed --prefill-chunk-size,
        --max-prefill-stall-ms 0, or no decode step measured yet for the default bound."""
        ms = self.config.max_prefill_stall_ms
        if self.config.prefill_chunk_size is not None or ms == 0:
            return None
        if ms is not None:
            return ms / 1000
        step = self.costs.decode_step.value
        return None if step is None else STALL_BOUND_STEPS * step

    def prefill_budget(self) -> float | None:
        """Seconds this tick's prefill pass may take; None = not limited by the stall bound:
        it is off, nothing decodes, or no decode step has been measured yet (the first tick
        of a server's first decode batch: token-count chunks, as with the bound off). A stream
        waits a decode step plus the pass, so the pass gets the bound less a decode step."""
        if not any(s.status is SequenceStatus.DECODING for s in self._running):
            return None
        bound, step = self.stall_bound(), self.costs.decode_step.value
        if bound is None or step is None:
            return None
        return max(0.0, bound - step)

    def _prefill_order(self, prefilling: list[Request]) -> list[Request]:
        """Priority order (FIFO within a priority), except that a request parked for
        --prefill-grant-interval ticks is guaranteed the next turn."""
        ordered = sorted(prefilling, key=lambda s: (-s.request.priority, s.arrival_order))
        grant = self.config.prefill_grant_interval
        if grant > 0:
            overdue = [s for s in ordered if s.parked_ticks >= grant]
            ordered = overdue + [s for s in ordered if s.parked_ticks < grant]
        return ordered

    def _prefill(self, prefilling: list[Request]) -> None:
        """One prefill pass: the next chunk of up to --max-batch-prefill sequences."""
        chunk = self.chunk_size()
        budget = self.prefill_budget()
        cap = self.config.max_batch_prefill_tokens
        if cap is None:
            cap = 2 * self.config.max_batch_prefill * min(chunk or 512, 512)
        rows: list[StepRow] = []
        chosen: list[Request] = []
        planned: list[RowShape] = []
        total = 0
        for seq in self._prefill_order(prefilling):
            if len(rows) >= max(1, self.config.max_batch_prefill):
                break
            start, end = seq.plan.next_chunk(seq.num_computed, chunk)
            if budget is not None:
                # The most tokens whose predicted time, with the rows already in the pass,
                # stays within the budget; the first row always gets a minimum chunk. On the
                # per-row path each row is a forward of its own.
                if self.engine.batched:
                    fit = self.costs.model.max_tokens(planned, start, budget, end - start)
                else:
                    left = budget - sum(self.costs.model.predict([row]) for row in planned)
                    fit = self.costs.model.max_tokens([], start, left, end - start)
                if fit < min(MIN_PREFILL_CHUNK, end - start):
                    if rows:
                        continue  # parked this tick: the pass's time budget is spent
                    fit = MIN_PREFILL_CHUNK
                end = min(end, start + fit)
            if rows and cap and total + (end - start) > cap:
                continue  # parked this tick: the batch's token budget is spent
            tokens = seq.all_token_ids[start:end]
            done = end >= seq.plan.total_tokens
            assert seq.blocks is not None  # the whole prompt was reserved at admission
            rows.append(StepRow(seq.engine_seq, tokens, done, seq.blocks.block_ids))
            chosen.append(seq)
            planned.append((len(tokens), start))
            total += len(tokens)
        for seq in prefilling:
            seq.parked_ticks = 0 if seq in chosen else seq.parked_ticks + 1
        if not rows:
            return
        self._touched = chosen
        results = self._prefill_rows(rows, budget)
        self._record_results(results)
        by_seq = {id(r.seq): r for r in results}
        for seq, row in zip(chosen, rows):
            result = by_seq.get(id(seq.engine_seq))
            if result is not None and result.error is not None:
                self._finish(seq, FinishReason.ERROR, error=result.error)
                continue
            seq.num_computed += len(row.tokens or ())
            self._commit(seq)
            self._event(
                seq, "prefill_chunk", tokens=len(row.tokens or ()), context=seq.num_computed
            )
            if row.sample:
                seq.status = SequenceStatus.DECODING
                self._accept(seq, by_seq[id(seq.engine_seq)])

    def _prefill_rows(self, rows: list[StepRow], budget: float | None) -> list[RowResult]:
        """Run the pass (one forward, or one per row on the per-row path), timing each forward
        for the cost model."""
        forwards = [rows] if self.engine.batched or len(rows) == 1 else [[r] for r in rows]
        bound = self.stall_bound() if budget is not None else None
        results: list[RowResult] = []
        for group in forwards:
            shape = [(len(r.tokens or ()), r.seq.num_cached) for r in group]
            predicted = self.costs.model.predict(shape) if budget is not None else None
            started = self._clock()
            out = self.engine.prefill(group, self.kv.take_update())
            seconds = self._clock() - started
            results += out
            self.costs.prefill_since_read += seconds
            if any(r.error is not None for r in out):
                continue  # a failed or retried forward says nothing about the cost
            self.costs.model.observe(shape, seconds)
            record = PrefillPass([r.seq.seq_id for r in group], shape, seconds, predicted, budget)
            self.costs.passes.append(record)
            log.debug(
                "prefill pass",
                request_ids=record.request_ids,
                tokens=[n for n, _ in shape],
                context=[c for _, c in shape],
                ms=round(seconds * 1000, 1),
                predicted_ms=_ms(predicted),
                budget_ms=_ms(budget),
                bound_ms=_ms(bound),
                step_ms=_ms(self.costs.decode_step.value),
            )
        return results

    def _decode_step(self) -> None:
        self._reserve_decode_blocks()
        rows = [s for s in self._running if s.status is SequenceStatus.DECODING]
        if not rows and self._inflight is None:
            self.costs.last_decode_read = None  # the next read starts a new run of steps
        spec = self.config.speculation
        if spec is not None and 0 < len(rows) <= spec.max_batch:
            # Drafts depend on the last token: the lookahead pipeline pauses for small batches.
            self._complete_inflight()
            rows = [s for s in self._running if s.status is SequenceStatus.DECODING]
            drafts = [self._draft(s, spec) for s in rows]
            if any(drafts):
                self._verify(rows, drafts)
                return
        if self._inflight is None:
            if rows:
                self._touched = rows
                self._inflight = self.engine.submit(
                    [self._decode_row(s) for s in rows], update=self.kv.take_update()
                )
            return
        # Queue the next step for rows that will surely need one, then read the current step.
        inflight_ids = {id(r.seq) for r in self._inflight.rows}
        continuing = [
            s
            for s in rows
            if id(s.engine_seq) in inflight_ids
            and s.num_generated + 1 < s.request.max_tokens
            and s.prompt_len + s.num_generated + 1 < self.config.slot_context
        ]
        rows_next = [self._decode_row(s) for s in continuing]
        self._touched = rows
        overlap = self.engine.config.overlap_steps
        nxt = None
        if continuing:
            nxt = self.engine.submit(rows_next, dispatch=overlap, update=self.kv.take_update())
        self._complete_inflight(then_dispatch=None if overlap else nxt)
        self._inflight = nxt

    @staticmethod
    def _decode_row(seq: Request) -> StepRow:
        assert seq.blocks is not None
        return StepRow(seq.engine_seq, block_ids=seq.blocks.block_ids)

    def _draft(self, seq: Request, spec: SpeculationConfig) -> list[int]:
        """Prompt-lookup draft tokens for a decoding row (none when it may not speculate)."""
        req = seq.request
        if req.sampling.has_penalties:
            return []  # penalties follow each token: they cannot score a draft in one pass
        room = min(
            spec.num_draft_tokens,
            req.max_tokens - seq.num_generated - 1,
            self.config.slot_context - seq.prompt_len - seq.num_generated - 1,
        )
        if spec.max_context is not None:
            room = min(room, spec.max_context - seq.prompt_len - seq.num_generated - 1)
        if room <= 0:
            return []
        if seq.lookup is None:
            seq.lookup = NgramIndex(spec.min_ngram, spec.max_ngram)
            seq.lookup.extend(seq.all_token_ids)
        return seq.lookup.propose(room)

    def _verify(self, rows: list[Request], drafts: list[list[int]]) -> None:
        """One forward checks every row's draft (rows without one take a plain step in it).
        A draft gets slots if the pool has them (else the row takes a plain step); the slots
        of the drafts the model rejects go back to the pool."""
        self._touched = rows
        draft_rows = []
        for s, draft in zip(rows, drafts):
            assert s.blocks is not None
            if not self.kv.ensure_slots(s.blocks, s.engine_seq.num_cached + 1 + len(draft)):
                draft = []  # the next token's slot is reserved already
            draft_rows.append(
                DraftRow(s.engine_seq, s.output_token_ids[-1], draft, s.blocks.block_ids)
            )
        results = self.engine.verify(draft_rows, self.kv.take_update())
        self.costs.decode_read(self._clock())  # a verify round is one step as the streams see it
        self._record_results([r for v in results for r in v.results])
        by_engine_seq = {id(s.engine_seq): s for s in rows}
        for verified in results:
            seq = by_engine_seq[id(verified.seq)]
            assert seq.blocks is not None
            self.kv.truncate(seq.blocks, verified.seq.num_cached)
        for verified in results:
            seq = by_engine_seq[id(verified.seq)]
            seq.drafted_tokens += verified.drafted
            seq.accepted_tokens += verified.accepted
            for result in verified.results:
                if seq.is_finished:
                    break  # e.g. EOS among the accepted tokens: the rest is dropped
                self._accept(seq, result)

    def _reserve_decode_blocks(self) -> None:
        """Each decoding row needs a slot for its next token before the forward. Short of
        blocks (cold prefixes are evicted by the pool first), preempt the lowest-priority
        running sequence with the least progress until the rest fit."""
        while True:
            decoding = [s for s in self._running if s.status is SequenceStatus.DECODING]
            if not decoding:
                return
            needed = sum(self._blocks_for_next_token(s) for s in decoding)
            if needed <= self.kv.num_free_blocks or len(self._running) <= 1:
                break
            victim = min(
                self._running,
                key=lambda s: (s.request.priority, s.num_generated, -s.arrival_order),
            )
            log.info("KV blocks short: preempting", request_id=victim.request_id)
            self.preempt(victim)
        for seq in decoding:
            assert seq.blocks is not None
            if not self.kv.ensure_slots(seq.blocks, seq.engine_seq.num_cached + 1):
                self._finish(seq, FinishReason.ERROR, error="KV cache exhausted")

    def _blocks_for_next_token(self, seq: Request) -> int:
        """New blocks a decoding row's next step needs: a slot for the position after those
        already fed (the step in flight included)."""
        assert seq.blocks is not None
        return self.kv.blocks_needed(seq.blocks, seq.engine_seq.num_cached + 1)

    def _complete_inflight(self, then_dispatch: PendingStep | None = None) -> None:
        """Read the in-flight step's tokens; queue `then_dispatch` as soon as they are read."""
        if self._inflight is None:
            if then_dispatch is not None:
                self.engine.dispatch(then_dispatch)
            return
        pending, self._inflight = self._inflight, None
        by_engine_seq = {id(s.engine_seq): s for s in self._running}
        self._touched = [
            by_engine_seq[id(r.seq)] for r in pending.rows if id(r.seq) in by_engine_seq
        ]
        results = self.engine.finish_rows(pending)
        self.costs.decode_read(self._clock())
        self._record_results(results)
        if then_dispatch is not None:
            self.engine.dispatch(then_dispatch)
        for result in results:
            seq = by_engine_seq.get(id(result.seq))
            if seq is None or seq.is_finished:
                continue  # ended while its step was in flight: drop the extra token
            self._accept(seq, result)

    def _record_results(self, results: list[RowResult]) -> None:
        if results:
            self._record_step(failed=all(r.error is not None for r in results))

    def _record_step(self, failed: bool) -> None:
        """Track engine health: several steps in a row whose every row failed mean the engine
        (not a request) is broken; one good step clears it."""
        self._failed_steps = self._failed_steps + 1 if failed else 0
        healthy = self._failed_steps < UNHEALTHY_AFTER_FAILED_STEPS
        if healthy != self.healthy:
            self.healthy = healthy
            if healthy:
                log.info("engine healthy again")
            else:
                log.error("engine unhealthy: every row of consecutive steps failed")
            if self._on_health is not None:
                self._on_health(healthy)

    # -- preemption -------------------------------------------------------------------
    def _preempt_for_waiting(self) -> None:
        """A higher-priority arrival on a full batch evicts a victim (policy-chosen)."""
        while self._waiting and len(self._running) >= self.config.max_batch_size:
            top_priority = -self._waiting[0][0]
            victims = [s for s in self._running if s.request.priority < top_priority]
            if not victims:
                return
            self.preempt(self.choose_victim(victims))

    def choose_victim(self, candidates: list[Request]) -> Request:
        if self.config.preemption_policy == "lowest-priority":
            return min(candidates, key=lambda s: (s.request.priority, -s.num_generated))
        return max(candidates, key=lambda s: (s.num_generated, -s.request.priority))

    def preempt(self, seq: Request) -> None:
        """Free a running sequence's KV and re-queue it; it keeps its generated tokens and
        is re-prefilled (prompt + generated so far) when admitted again."""
        self._complete_inflight()
        if seq.is_finished:
            return
        self._release_kv(seq)
        seq.status = SequenceStatus.QUEUED
        seq.num_computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._running.remove(seq)
        with self._lock:
            self._pending_admissions += 1
        heapq.heappush(self._waiting, (-seq.request.priority, seq.arrival_order, seq))
        self._event(seq, "preempted", generated=seq.num_generated)
        log.info("preempted", request_id=seq.request_id, generated=seq.num_generated)

    # -- results -------------------------------------------------------------------
    def _accept(self, seq: Request, result: RowResult) -> None:
        """Take one sampled token: stream it, and finish the sequence if it is done."""
        if result.error is not None:
            self._finish(seq, FinishReason.ERROR, error=result.error)
            return
        token = result.token_id
        assert token is not None
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self._event(seq, "first_token", ttft_seconds=now - seq.arrival)
        seq.output_token_ids.append(token)
        if seq.lookup is not None:
            seq.lookup.extend((token,))
        req = seq.request
        out = self._output(seq)
        out.token_ids.append(token)
        if req.logprobs and result.logprob is not None:
            out.logprobs.append(TokenLogprob(token, result.logprob, result.top_logprobs))
        if (token in self._eos and not req.ignore_eos) or token in req.stop_token_ids:
            self._finish(seq, FinishReason.STOP)
        elif (
            seq.num_generated >= req.max_tokens
            or seq.prompt_len + seq.num_generated >= self.config.slot_context
        ):
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Request, reason: FinishReason, error: str | None = None) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.blocks is not None:
            self.kv.free_sequence(seq.blocks)
            seq.blocks = None
        if seq.engine_seq is not None:
            self.engine.release(seq.engine_seq)
        if seq in self._running:
            self._running.remove(seq)
        if reason is FinishReason.ERROR:
            self.stats.total_failed += 1
        else:
            self.stats.total_completed += 1
        queue_s, ttft_s, total_s = seq.timing(time.monotonic())
        self._event(
            seq,
            "finished",
            finish_reason=reason.value,
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.num_generated,
            cached_tokens=seq.cached_tokens,
            preemptions=seq.preemptions,
        )
        self._output(seq).final = Final(
            reason.value,
            error,
            seq.prompt_len,
            seq.num_generated,
            seq.cached_tokens,
            queue_s,
            ttft_s,
            total_s,
            seq.drafted_tokens,
            seq.accepted_tokens,
        )
        log.info(
            "request finished",
            request_id=seq.request_id,
            finish_reason=reason.value,
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.num_generated,
            error=error,
        )

    def _release_kv(self, seq: Request) -> None:
        """Free a preempted sequence's KV; its computed full blocks stay in the prefix cache
        (evictable) so the resumed request (or a follow-up) can adopt them."""
        assert seq.blocks is not None
        self._commit(seq)
        self.kv.free_sequence(seq.blocks)
        seq.blocks = None
        self.engine.release(seq.engine_seq, final=False)
        seq.engine_seq = None

    def _end_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancel_requested]:
            self._finish(seq, FinishReason.CANCELLED)
        if any(s.cancel_requested for _, _, s in self._waiting):
            keep = []
            for item in self._waiting:
                if item[2].cancel_requested:
                    with self._lock:
                        self._pending_admissions -= 1
                    self._finish(item[2], FinishReason.CANCELLED)
                else:
                    keep.append(item)
            heapq.heapify(keep)
            self._waiting = keep

    def _fail_all_on_stop(self) -> None:
        """The server stops: what still runs or waits is cancelled (not failed)."""
        self._inflight = None
        for seq in list(self._running):
            self._finish(seq, FinishReason.CANCELLED, error="server shutting down")
        while self._waiting:
            _, _, seq = heapq.heappop(self._waiting)
            self._finish(seq, FinishReason.CANCELLED)

    def _output(self, seq: Request) -> StepOutput:
        """The request's output of this tick (made on first use)."""
        out = self._outbox.get(seq)
        if out is None:
            out = self._outbox[seq] = StepOutput(seq.rid)
        return out

    def _event(self, seq: Request, name: str, **attrs: int | float | str) -> None:
        self._output(seq).events.append((name, attrs))

    def _flush_outbox(self) -> None:
        """Publish the tick's stats (on_tick), then deliver its outputs: one `deliver` call
        per group of sinks that share a batch key (e.g. all requests of one front end: one
        message)."""
        outbox, self._outbox = self._outbox, {}
        self.stats.active_sequences = len(self._running)
        self.stats.queued_requests = self._pending_admissions
        if self._on_tick is not None:
            # Before delivery: whoever has seen a request's lifecycle change (admitted, first
            # token, finished, ...) finds it in the stats published from here.
            self._on_tick(self, any(out.events or out.finished for out in outbox.values()))
        groups: dict[object, tuple[OutputSink, list[StepOutput]]] = {}
        for seq, out in outbox.items():
            key = seq.sink.batch_key
            if key not in groups:
                groups[key] = (seq.sink, [])
            groups[key][1].append(out)
        for sink, outputs in groups.values():
            try:
                sink.deliver(outputs)
            except Exception:
                log.exception("delivering outputs failed")
