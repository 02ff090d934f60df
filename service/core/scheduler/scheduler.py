"""The iteration-level scheduler: decides, step by step, what the model runner runs.

`schedule()` returns the next step as data (service.core.scheduler.plan): it ends cancelled
sequences, admits waiting requests in priority order while the batch has room, picks one prefill
pass (the next chunk of each admitted prompt, batched), and one decode step for every decoding
row (or, while few rows decode with prompt-lookup speculation on, a verification of their
drafted tokens). `update(plan, result)` takes what the runner read back: it appends the sampled
tokens, finishes completed sequences at once and gathers each front end's outputs (Outbox).

The core loop (service.core.loop) pipelines the two: while a step runs, the next one may be
planned (`decode_only()`: nothing but decode rows that will surely need another token), so
Python bookkeeping overlaps device work. Per-row state the hot path reads lives in arrays over
the runner's slots; rows are Python objects only for what is per request anyway.

The scheduler owns the KV cache manager (service.core.kv.block_pool), as vLLM v1's and
nano-vllm's schedulers do: it adopts cached prefixes and reserves a prompt's slots at admission,
reserves each decode step's slot (preempting when blocks run short), registers computed full
blocks in the prefix cache, gives back the slots of rejected draft tokens, and frees a
sequence's blocks when it finishes or is preempted. Each plan carries the block tables that
changed and the manager's pending `BlockUpdate`; the runner only runs forwards.

It also decides the LoRA adapter slots (service.core.scheduler.adapters): a request takes its
adapter when it arrives (an adapter that is not served is refused then), its row joins with the
adapter's slot, its prefix-cache lookups stay within the adapter's namespace, and an adapter
being unloaded leaves the runner in the plan after its last request ended.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from service.core.kv.block_pool import KVManager
from service.core.scheduler.adapters import AdapterTable
from service.core.scheduler.constraints import Constraints, Verdict
from service.core.scheduler.outbox import Outbox
from service.core.scheduler.plan import (
    Chunk,
    Draft,
    RowJoin,
    RowLeave,
    RowMasks,
    StepPlan,
    StepResult,
)
from service.core.scheduler.prefill_cost import PrefillCostModel, RowShape, RunningMedian
from service.core.scheduler.prefill_plan import PrefillPlan
from service.core.scheduler.prompt_lookup import DraftPacing, NgramIndex
from service.core.scheduler.request import Request, SequenceStatus
from service.protocol import Final, FinishReason, TokenLogprob

log = structlog.get_logger(__name__)

ADAPTIVE_CHUNK_IDLE = 2048  # while nothing decodes: keeps a lone stream's TTFT low
ADAPTIVE_CHUNK_BUSY = 512  # while a decode batch runs, with the stall bound off (0)
# --max-prefill-stall-ms by default: this many median decode steps.
STALL_BOUND_STEPS = 4
# A stall-bounded chunk is never smaller (unless the prompt's rest is): the prefill always
# progresses. Two, not one: a one-token row would run as a decode-shaped step, which on the CPU
# path drops the decode batch's contiguous K/V copy.
MIN_PREFILL_CHUNK = 2
# Engine steps in a row whose every row failed before the engine counts as unhealthy (health
# NOT_SERVING) until a step succeeds again.
UNHEALTHY_AFTER_FAILED_STEPS = 3


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
    # A prompt's last token prefills alone, as mlx-lm prefills (PrefillPlan.last_alone): for
    # models on mlx-lm's own caches, which must give its numbers exactly.
    last_token_alone: bool = False


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
    total_completed: int = 0  # finished with a result: stop, length or cancelled
    total_failed: int = 0  # finished with an error
    preemptions: int = 0


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


@dataclass
class _PlannedPass:
    """What the scheduler planned for one prefill forward (for the cost model at update)."""

    seqs: list[Request]
    shape: list[RowShape]
    predicted: float | None
    budget: float | None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: frozenset[int],
        *,
        kv: KVManager,
        batched: bool = True,
        on_health: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        constraints: Constraints | None = None,
        adapters: AdapterTable | None = None,
    ) -> None:
        """kv: the KV manager of the runner's storage (a KVCacheManager for the paged pool,
        UnpagedKV for storage without blocks); batched: rows share a forward (else each
        prefill row is a forward of its own); on_health: told when the engine turns
        unhealthy or healthy again; clock: times decode steps for the stall bound;
        constraints: the rows' grammars, for requests with a response format (None: such a
        request fails); adapters: the LoRA adapters the runner serves, by slot."""
        self.config = config
        self.kv = kv
        self.constraints = constraints
        self.adapters = adapters if adapters is not None else AdapterTable()
        self.batched = batched
        self._on_health = on_health
        self._clock = clock
        self.costs = PrefillCosts()
        self.healthy = True
        self._failed_steps = 0  # consecutive steps in which every row failed
        self.stats = SchedulerStats()
        self._waiting: list[tuple[int, int, Request]] = []  # heap: (-priority, order, seq)
        self._running: list[Request] = []
        self._order = itertools.count()
        self._step = 0
        n = config.max_batch_size
        self._free_slots = list(range(n - 1, -1, -1))  # pop() hands out the lowest first
        self._owner: list[Request | None] = [None] * n
        self.outbox = Outbox(n)
        # Per slot, what the decode path reads each step.
        self._decoding = np.zeros(n, bool)
        self._occupied = np.zeros(n, bool)  # a request holds the slot (_owner is not None)
        self._awaiting_first = np.zeros(n, bool)  # its request has had no token yet
        self._fed = np.zeros(n, np.int64)  # positions submitted to the runner
        self._generated = np.zeros(n, np.int64)  # tokens read back
        self._prompt_len = np.zeros(n, np.int64)
        self._max_tokens = np.zeros(n, np.int64)
        self._ignore_eos = np.zeros(n, bool)
        self._stop_ids = np.zeros(n, bool)  # the request has stop_token_ids
        self._eos = np.asarray(sorted(eos_token_ids), np.int64)
        self._leaves: list[RowLeave] = []
        self._forget: list[str] = []
        self._dirty: set[int] = set()  # slots whose block table the runner has not seen
        self._passes: dict[int, list[_PlannedPass]] = {}  # step -> its prefill forwards
        # Steps whose constrained decode rows wait for masks: their decode slots.
        self._masks_due: dict[int, list[int]] = {}

    # -- requests ----------------------------------------------------------------------
    def add(self, seq: Request) -> None:
        """Queue a request; raises AdapterUnavailableError (nothing queued) when it names an
        adapter that is not served."""
        if seq.request.adapter:
            seq.adapter = self.adapters.acquire(seq.request.adapter)
        seq.arrival_order = next(self._order)
        heapq.heappush(self._waiting, (-seq.request.priority, seq.arrival_order, seq))
        self._event(seq, "queued", queue_depth=len(self._waiting))

    def cancel(self, seq: Request) -> None:
        """End `seq` (queued or running) as cancelled at the next plan; no-op once finished."""
        if not seq.is_finished:
            seq.cancel_requested = True

    @property
    def running(self) -> list[Request]:
        return self._running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_slots(self) -> int:
        return self.config.max_batch_size - len(self._running)

    def context_tokens(self, seq: Request) -> int:
        """Tokens in a running sequence's KV cache (its steps submitted so far)."""
        return int(self._fed[seq.slot]) if seq.slot >= 0 else seq.num_computed

    @property
    def busy(self) -> bool:
        """Something runs or waits, or the runner has yet to hear of rows that ended."""
        return bool(
            self._running
            or self._waiting
            or self._leaves
            or self._forget
            or self.adapters.unload_pending
        )

    # -- the plan ----------------------------------------------------------------------
    def decode_only(self) -> bool:
        """Whether the next plan is nothing but decode steps of rows already decoding (so it
        may be planned while the current step runs): no cancellation, admission, prefill,
        preemption or speculation pending."""
        if self._waiting and self.free_slots > 0:
            return False
        if self.config.enable_preemption and self._waiting and self._preemptible():
            return False
        spec = self.config.speculation
        decoding = int(self._decoding.sum())
        if spec is not None and 0 < decoding <= spec.max_batch and self._any_drafting():
            return False  # drafts are made from the last token: it must be read first
        return decoding > 0 and all(
            s.status is SequenceStatus.DECODING and not s.cancel_requested for s in self._running
        )

    def schedule(self) -> StepPlan | None:
        """The next step; None when there is nothing to run."""
        self._step += 1
        plan = StepPlan(self._step)
        self._end_cancelled()
        if self.config.enable_preemption:
            self._preempt_for_waiting()
        self._reserve_decode_blocks()
        self._admit(plan)
        prefilling = [s for s in self._running if s.status is SequenceStatus.PREFILLING]
        if prefilling:
            self._prefill(plan, prefilling)
        if not self._admits_a_burst(plan, prefilling):
            self._decode(plan)
        if self.constraints is not None and plan.has_forward:
            sampling = [c.slot for forward in plan.prefill for c in forward if c.sample]
            plan.masks = self.constraints.plan_masks(sampling, plan.verify)
            if plan.decode and self.constraints.active[plan.decode].any():
                self._masks_due[plan.step] = plan.decode
        self._seal(plan)
        if not plan.has_forward and not plan.changes:
            self._step -= 1
            return None
        return plan

    def decode_masks(self, plan: StepPlan) -> RowMasks | None:
        """The token masks of the plan's constrained decode rows (None: it had none when it
        was made). Asked for once the step before the plan is read: each depends on its row's
        last token (`update` started filling them). A row that ended meanwhile may get one: its
        token is dropped."""
        if self.constraints is None or plan.step not in self._masks_due:
            return None
        del self._masks_due[plan.step]
        masks = self.constraints.masks(plan.decode)
        return masks if masks is not None else RowMasks([], self.constraints.words, b"")

    def _seal(self, plan: StepPlan) -> None:
        """The plan's membership and table changes, and the pool's pending update."""
        plan.leaves, self._leaves = self._leaves, []
        plan.forget, self._forget = self._forget, []
        plan.unload = self.adapters.take_unloaded()
        for slot in sorted(self._dirty):
            seq = self._owner[slot]
            if seq is not None and seq.blocks is not None:
                plan.tables.append((slot, list(seq.blocks.block_ids)))
        self._dirty.clear()
        update = self.kv.take_update()
        plan.capacity, plan.copies = update.capacity, list(update.copies)

    # -- admission -----------------------------------------------------------------------
    def _admit(self, plan: StepPlan) -> None:
        while self._waiting and self._free_slots:
            seq = self._waiting[0][2]
            if seq.cancel_requested:
                heapq.heappop(self._waiting)
                self._finish(seq, FinishReason.CANCELLED)
                continue
            if seq.grammar is not None and self.constraints is None:
                heapq.heappop(self._waiting)
                self._finish(seq, FinishReason.ERROR, error="structured output is not available")
                continue
            if not self._start_sequence(seq, plan):
                break  # not enough KV blocks yet: the head of the queue waits for them
            heapq.heappop(self._waiting)
            seq.status = SequenceStatus.PREFILLING
            seq.parked_ticks = 0
            first = seq.admitted_at is None
            seq.admitted_at = seq.admitted_at or time.monotonic()
            self._running.append(seq)
            # The prefix-cache lookup of this admission, in tokens (what the metrics count).
            assert seq.plan is not None
            looked_up = seq.request.cache_prompt and self.kv.prefix_caching
            self._event(
                seq,
                "admitted" if first else "resumed",
                prefix_query_tokens=seq.plan.total_tokens if looked_up else 0,
                prefix_hit_tokens=seq.plan.cached_tokens,
            )

    def _start_sequence(self, seq: Request, plan: StepPlan) -> bool:
        """Give a waiting sequence its KV blocks and a runner slot: adopt a cached prefix,
        reserve the rest of its prompt's slots now (prefill chunks then never run out), plan
        its prefill. While a batch decodes, --kv-admission-watermark of the pool stays free
        for the running rows. False (nothing held) if blocks are short."""
        req = seq.request
        tokens = seq.all_token_ids
        adapter = seq.adapter
        root = adapter.root if adapter is not None else None
        blocks = self.kv.new_sequence(cache_prefix=req.cache_prompt, root=root)
        keep_free = 0
        if self._decoding.any():
            keep_free = int(self.config.kv_admission_watermark * self.kv.num_blocks)
        cached = self.kv.admit(blocks, tokens, req.cache_prompt, keep_free)
        if cached is None:
            return False
        slot = self._free_slots.pop()
        seq.slot, seq.blocks = slot, blocks
        self._owner[slot] = seq
        self._occupied[slot] = True
        self._awaiting_first[slot] = seq.first_token_at is None
        self.outbox.bind(slot, seq.sink, seq.rid)
        self._fed[slot] = cached
        self._generated[slot] = seq.num_generated
        self._prompt_len[slot] = seq.prompt_len
        self._max_tokens[slot] = req.max_tokens
        self._ignore_eos[slot] = req.ignore_eos
        self._stop_ids[slot] = bool(req.stop_token_ids)
        self._decoding[slot] = False
        self._dirty.add(slot)
        if seq.grammar is not None and self.constraints is not None:
            if seq.matcher is None:
                seq.matcher = seq.grammar.matcher()
            self.constraints.join(slot, seq.matcher)
        plan.joins.append(
            RowJoin(
                slot,
                seq.seq_id,
                req.sampling,
                list(req.prompt_token_ids),
                cached,
                req.logprobs,
                req.top_logprobs,
                resume=seq.preemptions > 0,
                constrained=seq.grammar is not None,
                adapter=adapter.slot if adapter is not None else 0,
            )
        )
        if seq.admitted_at is None:
            seq.cached_tokens = cached
        seq.plan = PrefillPlan(len(tokens), cached, last_alone=self.config.last_token_alone)
        seq.num_computed = cached
        return True

    def _commit(self, seq: Request) -> None:
        """Offer the sequence's computed full blocks to the prefix cache."""
        if seq.request.cache_prompt and seq.blocks is not None:
            computed = seq.all_token_ids[: int(self._fed[seq.slot])]
            self.kv.register_full_blocks(seq.blocks, computed)

    # -- prefill -------------------------------------------------------------------------
    def chunk_size(self) -> int | None:
        """Tokens per prefill chunk now (at most, while the stall bound sizes the chunks);
        None means the whole remainder at once."""
        fixed = self.config.prefill_chunk_size
        if fixed is not None:
            return fixed or None
        if not self._decoding.any() or self.prefill_budget() is not None:
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
        """Seconds this plan's prefill pass may take; None = not limited by the stall bound:
        it is off, nothing decodes, no decode step has been measured yet, or more prompts
        prefill than rows decode (a burst: the bound would keep more requests from their first
        token than it spares streams a longer gap). A stream waits a decode step plus the pass,
        so the pass gets the bound less a decode step."""
        decoding = int(np.count_nonzero(self._decoding))
        if not decoding or self._burst(decoding):
            return None
        bound, step = self.stall_bound(), self.costs.decode_step.value
        if bound is None or step is None:
            return None
        return max(0.0, bound - step)

    def _burst(self, decoding: int) -> bool:
        """A burst is arriving: more prompts prefill (hold a slot, not decoding) than rows
        decode. The stall bound does not hold its passes, nor does a decode step beside them."""
        return int(np.count_nonzero(self._occupied)) - decoding > decoding

    def _prefill_order(self, prefilling: list[Request]) -> list[Request]:
        """Priority order (FIFO within a priority), except that a request parked for
        --prefill-grant-interval ticks is guaranteed the next turn."""
        ordered = sorted(prefilling, key=lambda s: (-s.request.priority, s.arrival_order))
        grant = self.config.prefill_grant_interval
        if grant > 0:
            overdue = [s for s in ordered if s.parked_ticks >= grant]
            ordered = overdue + [s for s in ordered if s.parked_ticks < grant]
        return ordered

    def _prefill(self, plan: StepPlan, prefilling: list[Request]) -> None:
        """One prefill pass: the next chunk of up to --max-batch-prefill sequences."""
        chunk = self.chunk_size()
        budget = self.prefill_budget()
        cap = self.config.max_batch_prefill_tokens
        if cap is None:
            cap = 2 * self.config.max_batch_prefill * min(chunk or 512, 512)
        chunks: list[Chunk] = []
        chosen: list[Request] = []
        planned: list[RowShape] = []
        total = 0
        for seq in self._prefill_order(prefilling):
            if len(chunks) >= max(1, self.config.max_batch_prefill):
                break
            assert seq.plan is not None
            start, end = seq.plan.next_chunk(seq.num_computed, chunk)
            if budget is not None:
                end = self._fit_budget(planned, start, end, budget, first=not chunks)
                if end is None:
                    continue  # parked this tick: the pass's time budget is spent
            if chunks and cap and total + (end - start) > cap:
                continue  # parked this tick: the batch's token budget is spent
            tokens = seq.all_token_ids[start:end]
            chunks.append(Chunk(seq.slot, tokens, end >= seq.plan.total_tokens))
            chosen.append(seq)
            planned.append((len(tokens), start))
            total += len(tokens)
        taken = {id(seq) for seq in chosen}
        for seq in prefilling:
            seq.parked_ticks = 0 if id(seq) in taken else seq.parked_ticks + 1
        if not chunks:
            return
        groups = [list(range(len(chunks)))] if self.batched else [[i] for i in range(len(chunks))]
        passes = []
        for group in groups:
            shape = [planned[i] for i in group]
            predicted = self.costs.model.predict(shape) if budget is not None else None
            plan.prefill.append([chunks[i] for i in group])
            passes.append(_PlannedPass([chosen[i] for i in group], shape, predicted, budget))
        self._passes[plan.step] = passes
        for c in chunks:
            self._fed[c.slot] += len(c.tokens)

    def _fit_budget(
        self, planned: list[RowShape], start: int, end: int, budget: float, first: bool
    ) -> int | None:
        """The chunk's end within the pass's time budget: the most tokens whose predicted
        time, with the rows already in the pass, stays within it; the first row always gets
        a minimum chunk. On the per-row path each row is a forward of its own. None: parked."""
        model = self.costs.model
        if self.batched:
            fit = model.max_tokens(planned, start, budget, end - start)
        else:
            left = budget - sum(model.predict([row]) for row in planned)
            fit = model.max_tokens([], start, left, end - start)
        if fit < min(MIN_PREFILL_CHUNK, end - start):
            if not first:
                return None
            fit = MIN_PREFILL_CHUNK
        return min(end, start + fit)

    # -- decode --------------------------------------------------------------------------
    def _admits_a_burst(self, plan: StepPlan, prefilling: list[Request]) -> bool:
        """Whether this plan only prefills: a burst is arriving (more prompts prefill than rows
        decode, two at least: a lone prompt decodes in the plan that prefills it, as before)
        and its pass ends every one of their prefills. A decode step after the pass would hold
        the prompts that arrive meanwhile back by a step of every row; without it the rows that
        decode wait a pass once, and the burst's rows then step together. A pass that leaves
        prompts to prefill (chunked, or a CPU's few rows a pass) never holds decoding back."""
        if not plan.prefill or len(prefilling) < 2:
            return False
        if not self._burst(int(np.count_nonzero(self._decoding))):
            return False
        ending = sum(1 for forward in plan.prefill for c in forward if c.sample)
        return ending == len(prefilling)

    def _decode(self, plan: StepPlan) -> None:
        """One decode step for every decoding row that needs another token, and for the rows
        whose prefill ends in this plan (they feed the token it samples) where a slot for it is
        to be had. The decoding rows' slots were reserved before admission."""
        rows = self._decoding.copy()
        rows[self._ending_with_a_slot(plan)] = True
        slots = self._continuing(rows)
        if not len(slots):
            self.costs.last_decode_read = None  # the next read starts a new run of steps
            return
        spec = self.config.speculation
        if spec is not None and len(slots) <= spec.max_batch and not plan.prefill:
            drafts = [self._draft(self._owner[s], spec) for s in slots.tolist()]
            if any(drafts):
                self._verify(plan, slots, drafts)
                return
        plan.decode = slots.tolist()
        self._fed[slots] += 1

    def _ending_with_a_slot(self, plan: StepPlan) -> list[int]:
        """Rows whose prefill ends in this plan and that can decode in it too: a slot for the
        token after the prompt is reserved (never by preempting: they take a plain turn
        next plan instead). With speculation, while few rows decode, they wait a plan: their
        drafts are made from the token the prefill samples, not known yet."""
        ending = [c.slot for forward in plan.prefill for c in forward if c.sample]
        if self.constraints is not None:
            # A constrained row's next mask depends on the token its prefill samples, which
            # is read after the plan is made: it decodes from the next plan on.
            ending = [s for s in ending if not self.constraints.active[s]]
        spec = self.config.speculation
        if (
            ending
            and spec is not None
            and len(ending) + int(self._decoding.sum()) <= spec.max_batch
        ):
            return []
        out = []
        for slot in ending:
            seq = self._owner[slot]
            assert seq is not None and seq.blocks is not None
            if self.kv.ensure_slots(seq.blocks, int(self._fed[slot]) + 1):
                self._dirty.add(slot)
                out.append(slot)
        return out

    def _continuing(self, rows: np.ndarray) -> np.ndarray:
        """Slots among `rows` (a mask) with room left for one more token: max_tokens and the
        slot context, counting the tokens of steps submitted but not read yet."""
        slots = np.flatnonzero(rows)
        total = self._fed[slots] - self._prompt_len[slots] + 1
        room = (total < self._max_tokens[slots]) & (
            self._prompt_len[slots] + total < self.config.slot_context
        )
        return slots[room].astype(np.int32)

    def _reserve_decode_blocks(self) -> None:
        """Each decoding row needs a slot for its next token before the forward. Short of
        blocks (cold prefixes are evicted by the pool first), preempt the lowest-priority
        running sequence with the least progress until the rest fit. Rows whose next position
        lies in a block they hold need nothing but a count. Runs before admission: a plan's
        own new rows are never its victims."""
        if not self.kv.paged:
            return
        size = self.kv.block_size
        while True:
            slots = self._continuing(self._decoding).tolist()
            need = (self._fed[slots] + 1).tolist()
            # One pass: the rows that stay inside their blocks are counted at once (a
            # preemption below frees only the victim's blocks), the others are collected.
            crossing = []
            for slot, n in zip(slots, need):
                blocks = self._owner[slot].blocks
                if n > len(blocks.block_ids) * size:
                    crossing.append((slot, n))
                elif n > blocks.num_tokens:
                    blocks.num_tokens = n
            if len(crossing) <= self.kv.num_free_blocks or len(self._running) <= 1:
                break
            victim = min(
                self._running,
                key=lambda s: (s.request.priority, s.num_generated, -s.arrival_order),
            )
            log.info("KV blocks short: preempting", request_id=victim.request_id)
            self.preempt(victim)
        for slot, n in crossing:
            seq = self._owner[slot]
            assert seq is not None and seq.blocks is not None
            if self.kv.ensure_slots(seq.blocks, n):
                self._dirty.add(slot)
            else:
                self._finish(seq, FinishReason.ERROR, error="KV cache exhausted")

    # -- speculative decoding ----------------------------------------------------------
    def _any_drafting(self) -> bool:
        """Whether a decoding row may draft in the next plan (not paused by its pacing)."""
        return any(
            s.status is SequenceStatus.DECODING
            and not s.request.sampling.has_penalties
            and (s.pacing is None or s.pacing.ready)
            for s in self._running
        )

    def _draft(self, seq: Request | None, spec: SpeculationConfig) -> list[int]:
        """Prompt-lookup draft tokens for a decoding row (none when it may not speculate, or
        while its pacing says its drafts do not pay)."""
        if seq is None or seq.status is not SequenceStatus.DECODING:
            return []
        req = seq.request
        if req.sampling.has_penalties:
            return []  # penalties follow each token: they cannot score a draft in one pass
        if seq.pacing is None:
            seq.pacing = DraftPacing(spec.num_draft_tokens)
        allowed = seq.pacing.allowed()
        if allowed == 0 or self._fed[seq.slot] > seq.prompt_len + seq.num_generated - 1:
            return []  # paused, or its last token is still in flight (planned ahead)
        room = min(
            allowed,
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
        draft = seq.lookup.propose(room)
        if self.constraints is not None:
            draft = self.constraints.draft(seq.slot, draft)
        if not draft:
            seq.pacing.miss()
        return draft

    def _verify(self, plan: StepPlan, slots: np.ndarray, drafts: list[list[int]]) -> None:
        """One forward checks every row's draft (rows without one take a plain step in it).
        A draft gets slots if the pool has them (else the row takes a plain step)."""
        for slot, draft in zip(slots.tolist(), drafts):
            seq = self._owner[slot]
            assert seq is not None and seq.blocks is not None
            if draft and not self.kv.ensure_slots(
                seq.blocks, int(self._fed[slot]) + 1 + len(draft)
            ):
                draft = []  # the next token's slot is reserved already
            self._dirty.add(slot)
            plan.verify.append(Draft(slot, draft))
            self._fed[slot] += 1 + len(draft)

    # -- results -------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Take a step's results (all of it, or its prefill part first and the rest later):
        prefill progress, the sampled tokens (ending the sequences that are done), the
        rejected drafts' slots, engine health and the stall bound's timings."""
        self._prefilled(plan, result)
        self._record_step(result)
        if result.decoded:
            self.costs.decode_read(self._clock())
        if plan.verify and result.decoded:
            self._verified(plan, result)
            return
        self._fail_rows(result.errors)
        # A row whose prefill ended in this step may have decoded in it too: its prefill
        # token first (it may end the row).
        k = result.prefill_rows
        if 0 < k < len(result.slots):
            head, tail = np.arange(k), np.arange(k, len(result.slots))
            self._accept(result.slots[:k], result.tokens[:k], _subset(result, head, head), False)
            self._accept(result.slots[k:], result.tokens[k:], _subset(result, tail, tail))
        else:
            self._accept(result.slots, result.tokens, result)

    def masks_due(self, plan: StepPlan) -> bool:
        """The plan's constrained decode rows wait for their masks (`decode_masks`)."""
        return plan.step in self._masks_due

    def _prefilled(self, plan: StepPlan, result: StepResult) -> None:
        passes = self._passes.pop(plan.step, [])
        for forward, planned, seconds in zip(plan.prefill, passes, result.prefill_seconds):
            failed = any(c.slot in result.errors for c in forward)
            if not failed and seconds == seconds:  # NaN: a forward that was redone
                self._observe_pass(planned, seconds)
            self.costs.prefill_since_read += seconds if seconds == seconds else 0.0
            for c, seq in zip(forward, planned.seqs):
                if seq.is_finished or self._owner[c.slot] is not seq:
                    continue
                if c.slot in result.errors:
                    self._finish(seq, FinishReason.ERROR, error=result.errors[c.slot])
                    continue
                seq.num_computed += len(c.tokens)
                self._commit(seq)
                self._event(seq, "prefill_chunk", tokens=len(c.tokens), context=seq.num_computed)
                if c.sample:
                    seq.status = SequenceStatus.DECODING
                    self._decoding[c.slot] = True

    def _observe_pass(self, planned: _PlannedPass, seconds: float) -> None:
        self.costs.model.observe(planned.shape, seconds)
        record = PrefillPass(
            [s.request_id for s in planned.seqs],
            planned.shape,
            seconds,
            planned.predicted,
            planned.budget,
        )
        self.costs.passes.append(record)
        log.debug(
            "prefill pass",
            request_ids=record.request_ids,
            tokens=[n for n, _ in planned.shape],
            context=[c for _, c in planned.shape],
            ms=round(seconds * 1000, 1),
            predicted_ms=_ms(planned.predicted),
            budget_ms=_ms(planned.budget),
            bound_ms=_ms(self.stall_bound()),
            step_ms=_ms(self.costs.decode_step.value),
        )

    def _fail_rows(self, errors: dict[int, str]) -> None:
        for slot, message in errors.items():
            seq = self._owner[slot]
            if seq is not None:
                self._finish(seq, FinishReason.ERROR, error=message)

    def _accept(
        self, slots: np.ndarray, tokens: np.ndarray, result: StepResult, last: bool = True
    ) -> None:
        """Append one sampled token to each row, stream it, and finish the rows it ends: EOS, a
        stop token, max_tokens or the slot context. `last`: no more of the step's tokens
        follow (the masks of the step planned after it can start filling)."""
        if not len(slots):
            return
        live = self._occupied[slots]  # a finished request has left its slot
        if not live.all():  # rows that ended while their step ran: drop their tokens
            slots, tokens, result = slots[live], tokens[live], _subset(result, live, live)
            if not len(slots):
                return
        owners = [self._owner[s] for s in slots.tolist()]
        self.outbox.tokens(slots, tokens, None)
        if result.logprobs is not None:
            self._logprobs(owners, result, None)
        for seq, token in zip(owners, tokens.tolist()):
            seq.output_token_ids.append(token)
            if seq.lookup is not None:
                seq.lookup.extend((token,))
        firsts = np.flatnonzero(self._awaiting_first[slots])
        if len(firsts):
            self._first_tokens([owners[i] for i in firsts.tolist()])
        stop = np.isin(tokens, self._eos) & ~self._ignore_eos[slots]
        for i in np.flatnonzero(self._stop_ids[slots]).tolist():
            stop[i] |= int(tokens[i]) in owners[i].request.stop_token_ids
        refused: dict[int, str] = {}
        if self.constraints is not None:
            for i, verdict, why in self.constraints.accept_many(slots, tokens):
                stop[i] |= verdict is Verdict.END
                if verdict is Verdict.REFUSED:
                    refused[i] = why
            if last and self._masks_due:
                # The step planned after this one waits for masks that depend on the tokens
                # just taken: they fill while this thread goes on until it samples that step.
                self.constraints.begin(self._masks_due[max(self._masks_due)])
        self._generated[slots] += 1
        generated = self._generated[slots]
        length = (generated >= self._max_tokens[slots]) | (
            self._prompt_len[slots] + generated >= self.config.slot_context
        )
        for i, why in refused.items():
            log.error("structured output failed", request_id=owners[i].request_id, error=why)
            self._finish(owners[i], FinishReason.ERROR, error=why)
        for i in np.flatnonzero(stop | length).tolist():
            self._finish(owners[i], FinishReason.STOP if stop[i] else FinishReason.LENGTH)

    def _accept_verified(self, result: StepResult) -> None:
        """A verification step's emitted tokens, row by row (few rows verify): each is taken
        in order until one ends the row; the rest is dropped."""
        assert result.counts is not None
        offset = 0
        kept_slots, kept_tokens, kept_counts, kept_rows = [], [], [], []
        for i, slot in enumerate(result.slots.tolist()):
            n = int(result.counts[i])
            emitted = result.tokens[offset : offset + n].tolist()
            rows = np.arange(offset, offset + n)
            offset += n
            seq = self._owner[slot]
            if seq is None or seq.is_finished:
                continue
            req = seq.request
            ends = set(req.stop_token_ids)
            if not req.ignore_eos:
                ends |= set(self._eos.tolist())
            taken = []
            reason = None
            error = None
            for token in emitted:
                taken.append(token)
                verdict = Verdict.CONTINUE
                if token not in ends and self.constraints is not None:
                    verdict, error = self.constraints.accept(slot, token)
                if verdict is Verdict.REFUSED:
                    reason = FinishReason.ERROR
                elif token in ends or verdict is Verdict.END:
                    reason = FinishReason.STOP
                elif seq.num_generated + len(taken) >= req.max_tokens or (
                    seq.prompt_len + seq.num_generated + len(taken) >= self.config.slot_context
                ):
                    reason = FinishReason.LENGTH
                if reason is not None:
                    break
            seq.output_token_ids.extend(taken)
            self._generated[slot] = seq.num_generated
            if seq.lookup is not None:
                seq.lookup.extend(taken)
            kept_slots.append(slot)
            kept_tokens.extend(taken)
            kept_counts.append(len(taken))
            kept_rows.extend(rows[: len(taken)].tolist())
            self._first_tokens([seq])
            if seq.request.logprobs and result.logprobs is not None:
                sub = _subset(result, np.ones(0, bool), np.asarray(rows[: len(taken)]))
                self._logprobs([seq], sub, np.asarray([len(taken)]))
            if reason is not None:
                self._finish(seq, reason, error=error or None)
        self.outbox.tokens(
            np.asarray(kept_slots, np.int32),
            np.asarray(kept_tokens, np.int32),
            np.asarray(kept_counts, np.int32),
        )

    def _first_tokens(self, owners: list[Request]) -> None:
        for seq in owners:
            if seq.first_token_at is None:
                now = time.monotonic()
                seq.first_token_at = now
                self._event(seq, "first_token", ttft_seconds=now - seq.arrival)
            if seq.slot >= 0:
                self._awaiting_first[seq.slot] = False

    def _logprobs(
        self, owners: list[Request], result: StepResult, counts: np.ndarray | None
    ) -> None:
        assert result.logprobs is not None
        offset = 0
        for i, seq in enumerate(owners):
            n = 1 if counts is None else int(counts[i])
            if seq.request.logprobs:
                k = seq.request.top_logprobs
                entries = []
                for j in range(offset, offset + n):
                    top: list[tuple[int, float]] = []
                    if k and result.top_ids is not None and result.top_logprobs is not None:
                        # A token a response format forbids (-inf) is no alternative.
                        top = [
                            (t, v)
                            for t, v in zip(
                                result.top_ids[j, :k].tolist(), result.top_logprobs[j, :k].tolist()
                            )
                            if v > -np.inf
                        ]
                    entries.append(
                        TokenLogprob(int(result.tokens[j]), float(result.logprobs[j]), top)
                    )
                self.outbox.logprobs(seq.sink, seq.rid, entries)
            offset += n

    def _verified(self, plan: StepPlan, result: StepResult) -> None:
        """A verification step: roll each row's KV back to what it accepted, then take its
        emitted tokens."""
        assert result.counts is not None and result.drafted is not None
        self._fail_rows(result.errors)
        starts = {d.slot: int(self._fed[d.slot]) - 1 - len(d.tokens) for d in plan.verify}
        for i, slot in enumerate(result.slots.tolist()):
            seq = self._owner[slot]
            if seq is None or seq.is_finished:
                continue
            self._fed[slot] = starts[slot] + int(result.counts[i])
            assert seq.blocks is not None
            self.kv.truncate(seq.blocks, int(self._fed[slot]))
            self._dirty.add(slot)
            drafted, accepted = int(result.drafted[i]), int(result.counts[i]) - 1
            seq.drafted_tokens += drafted
            seq.accepted_tokens += accepted
            if seq.pacing is not None:
                seq.pacing.record(drafted, accepted)
            if drafted:
                self.outbox.drafts(seq.sink, seq.rid, drafted, accepted)
        self._accept_verified(result)

    def _record_step(self, result: StepResult) -> None:
        """Track engine health: several steps in a row whose every row failed mean the engine
        (not a request) is broken; one good step clears it."""
        if not len(result.slots) and not result.errors:
            return
        failed = bool(result.errors) and not len(result.slots)
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

    def fail_running(self, touched: list[Request] | None = None) -> None:
        """A step failed outside the runner's per-row containment: end what it touched."""
        for seq in list(touched if touched is not None else self._running):
            if not seq.is_finished:
                self._finish(seq, FinishReason.ERROR, error="inference backend error")
        self._failed_steps += 1
        self._masks_due.clear()

    # -- preemption -----------------------------------------------------------------------
    def _preemptible(self) -> bool:
        top_priority = -self._waiting[0][0]
        return any(s.request.priority < top_priority for s in self._running)

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
        if seq.is_finished:
            return
        self._commit(seq)  # its computed full blocks stay in the prefix cache (evictable)
        self._release(seq, final=False)
        seq.status = SequenceStatus.QUEUED
        seq.num_computed = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        heapq.heappush(self._waiting, (-seq.request.priority, seq.arrival_order, seq))
        self._event(seq, "preempted", generated=seq.num_generated)
        log.info("preempted", request_id=seq.request_id, generated=seq.num_generated)

    # -- ending ---------------------------------------------------------------------------
    def _release(self, seq: Request, final: bool) -> None:
        """Free the sequence's KV and its slot (the runner is told in the next plan)."""
        if seq.blocks is not None:
            self.kv.free_sequence(seq.blocks)
            seq.blocks = None
        if seq.slot >= 0:
            slot = seq.slot
            if self.constraints is not None:
                self.constraints.leave(slot)  # a preempted request keeps its matcher
            self._leaves.append(RowLeave(slot, final))
            self._owner[slot] = None
            self._occupied[slot] = False
            self._decoding[slot] = False
            self._dirty.discard(slot)
            self._free_slots.append(slot)
            self._free_slots.sort(reverse=True)
            seq.slot = -1
        if seq in self._running:
            self._running.remove(seq)

    def _finish(self, seq: Request, reason: FinishReason, error: str | None = None) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.slot < 0 and seq.preemptions:
            self._forget.append(seq.seq_id)  # the runner still keeps its sampler
        self._release(seq, final=True)
        if seq.adapter is not None:
            self.adapters.release(seq.adapter)
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
        final = Final(
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
        self.outbox.final(seq.sink, seq.rid, final)
        log.info(
            "request finished",
            request_id=seq.request_id,
            adapter=seq.request.adapter or None,
            finish_reason=reason.value,
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.num_generated,
            error=error,
            # From its arrival at the engine core: where a client's latency is spent.
            queue_ms=round(queue_s * 1000, 1),
            ttft_ms=round(ttft_s * 1000, 1),
            total_ms=round(total_s * 1000, 1),
        )

    def _end_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancel_requested]:
            self._finish(seq, FinishReason.CANCELLED)
        if any(s.cancel_requested for _, _, s in self._waiting):
            keep = []
            for item in self._waiting:
                if item[2].cancel_requested:
                    self._finish(item[2], FinishReason.CANCELLED)
                else:
                    keep.append(item)
            heapq.heapify(keep)
            self._waiting = keep

    def cancel_all(self) -> None:
        """The server stops: what still runs or waits is cancelled (not failed)."""
        for seq in list(self._running):
            self._finish(seq, FinishReason.CANCELLED, error="server shutting down")
        while self._waiting:
            _, _, seq = heapq.heappop(self._waiting)
            self._finish(seq, FinishReason.CANCELLED)

    def _event(self, seq: Request, name: str, **attrs: int | float | str) -> None:
        self.outbox.event(seq.sink, seq.rid, (name, attrs))


def _subset(result: StepResult, rows: np.ndarray, tokens: np.ndarray) -> StepResult:
    """The result's entries of the kept rows (`rows`: per row, `tokens`: per token)."""
    out = StepResult(result.step, result.slots[rows], result.tokens[tokens])
    if result.logprobs is not None:
        out.logprobs = result.logprobs[tokens]
    if result.top_ids is not None and result.top_logprobs is not None:
        out.top_ids, out.top_logprobs = result.top_ids[tokens], result.top_logprobs[tokens]
    return out
