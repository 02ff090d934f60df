"""The model runner: executes the scheduler's step plans. Mechanism, no policy.

It keeps a table of rows, indexed by slot (service.core.scheduler.plan), from the plan a row
joins in to the plan it leaves in: each row's storage handle, sampler state, position and block
table. Positions and block tables are arrays over the slots, so a decode step's inputs (tokens,
offsets, slot tables) are gathered with a few array operations whatever the batch size.

`submit(plan)` applies the plan's changes, runs its prefill forwards (each read at once: the
scheduler times them), and builds its decode (or verification) forward, queued on the device
without waiting unless `dispatch=False`. `collect(pending)` is the evaluation boundary: it
reads the sampled tokens into a `StepResult`. A decode row feeds the token its previous step
sampled before that token is read: that is what lets the core loop queue step N+1 before it
reads step N.

Rows with a response format (structured output) sample under a token mask, applied to the
batch's logits in one op before penalties and sampling (sampler.apply_token_masks). Masks known
when the plan is made come with it (prefills that sample, verifications); a decode step's
depend on the tokens of the step before, so a decode forward with constrained rows stops at its
logits: `dispatch` queues those, and `sample(pending, masks)` samples once the step before is
read and its masks are filled, while the forward runs. A batch without constrained rows runs
as before.

Each row may use a LoRA adapter (service.core.models.lora): the table keeps its adapter slot, and
every forward publishes its rows' slots (`row_adapters`) while it is built, the LM head's rows
included. Adapters are loaded between steps (`load_adapter`) and cleared by the plan that
follows the last row using them (`StepPlan.unload`).

If building or evaluating a batched forward raises, its rows are run one by one, so that only
the failing rows end (the result's `errors`); under tensor parallel (`contain_failures=False`)
the error propagates instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import structlog

from service.core.engine import paged_attention
from service.core.engine.batch_view import StepLayout
from service.core.engine.compiled_decode import DecodeGraph
from service.core.engine.config import EngineConfig
from service.core.engine.kv_paged import SlotsNotReservedError
from service.core.engine.memory import release_freed_memory
from service.core.engine.sampler import (
    RowSamplerState,
    apply_token_masks,
    masked_argmax,
    sample,
    upload_words,
    verify_draft,
)
from service.core.engine.state_store import SequenceState, StateStore, StateUndo
from service.core.engine.storage import KVStorage
from service.core.models import lora, rope
from service.core.models.layout import CacheLayout
from service.core.scheduler.plan import Chunk, Draft, RowJoin, RowMasks, StepPlan, StepResult
from service.protocol import AdapterDescription

log = structlog.get_logger(__name__)

BACKEND_ERROR = "inference backend error"  # what a failed request's caller is told


class EngineError(RuntimeError):
    """An evaluation failed for a row; the message is safe to show to the caller."""


class EmptySlotError(ValueError):
    """A plan names a slot with no row in it (the scheduler's bug, not the rows')."""


@dataclass(eq=False)
class Row:
    """The runner's state of one row (a sequence) while it is in the table."""

    slot: int
    seq_id: str
    kv: Any  # the storage's handle
    sampler: RowSamplerState
    want_logprobs: bool = False
    top_logprobs: int = 0
    state: SequenceState | None = None  # recurrent state (stateful models)
    constrained: bool = False  # samples under a token mask (a response format)

    @property
    def argmax(self) -> bool:
        """Greedy with nothing per row to apply but its token mask: one argmax over the batch's
        (masked) logits."""
        p = self.sampler.params
        return p.greedy and not p.logit_bias and not p.has_penalties and not self.want_logprobs

    @property
    def plain(self) -> bool:
        """An argmax row with no token mask: sampled inside the compiled decode graph."""
        return self.argmax and not self.constrained


# Token bitmasks by slot: int32 [positions, words], a row per sampling position.
Masks = dict[int, np.ndarray]


def masks_by_slot(masks: RowMasks | None) -> Masks:
    if masks is None:
        return {}
    words = masks.array()
    if len(set(masks.slots)) == len(masks.slots):  # one position per slot: views, no copies
        return {slot: words[i : i + 1] for i, slot in enumerate(masks.slots)}
    out: dict[int, list[np.ndarray]] = {}
    for slot, row in zip(masks.slots, words):
        out.setdefault(slot, []).append(row)
    return {slot: np.stack(rows) for slot, rows in out.items()}


@dataclass
class _Staged:
    """A decode step's masks, made ready for its sample by `stage_masks`."""

    given: RowMasks  # what `sample` will be called with
    by_slot: Masks
    words: np.ndarray  # one row per sampled row
    uploaded: mx.array  # `words` on the device


@dataclass
class _Forward:
    """One built forward: its rows, what it sampled (device arrays) and how to undo it."""

    slots: np.ndarray  # int32 [B]
    rows: list[Row]  # the rows as they were when it was built
    lengths: np.ndarray  # int32 [B] tokens fed per row
    sampled: np.ndarray  # int32 [S] indices into slots of the rows that sampled
    tokens: mx.array | None  # [S] sampled
    logprobs: mx.array | None = None  # [S]
    top: tuple[mx.array, mx.array] | None = None  # ([S, K] ids, [S, K] logprobs)
    hidden: mx.array | None = None  # when no row sampled: what must be evaluated
    undo: StateUndo | None = None
    inputs: list[list[int] | None] = field(default_factory=list)  # per row, for a redo alone
    # Where the sampled rows' next inputs were before this forward sampled (for a redo).
    sources: tuple[np.ndarray, np.ndarray] | None = None
    errors: dict[int, str] = field(default_factory=dict)  # rows that failed (slot -> message)
    read: StepResult | None = None  # rows run one by one: already read
    # Constrained rows waiting for their masks: the logits to sample ([S, V]) once given.
    logits: mx.array | None = None
    masks: Masks | None = None  # the masks it sampled under (a redo applies them again)
    staged: _Staged | None = None  # masks made ready for `sample` while it was dispatched
    parts: list[_Forward] | None = None  # rows run one by one, some waiting for masks
    dispatched: bool = False
    # `tokens` as the host reads them, when steps are read beside the next one's dispatch: the
    # next step's graph takes `tokens` as its input, and an MLX array must not be waited on by
    # one thread while another evaluates a graph through it.
    readout: mx.array | None = None


@dataclass
class Pending:
    """A submitted plan: its prefill forwards' results (read already) and its decode forward."""

    plan: StepPlan
    prefill: list[StepResult]
    decode: _Forward | None
    verified: StepResult | None = None


# Test hook: (row, "build" | "evaluate") -> whether that stage fails for it.
FaultInjector = Callable[[Row, str], bool]


# The fewest key positions a padded multi-token forward attends over. A burst's prompts that
# share a chat template's cached blocks start 16 or 32 positions in: their pass gathers and
# attends over this many keys at least, so a low floor keeps such a pass near the cost of
# one with nothing cached (docs/kv-cache.md). The warm-up builds every span from here to
# GATHERED_SPAN_CAP.
MIN_PADDED_SPAN = 64
# The widest span of a chunk after a cached prefix built at start; wider ones (long prompts'
# later chunks) build on first use.
GATHERED_SPAN_CAP = 256


def shape_bucket(n: int) -> int:
    """Round a multi-token forward's length up: powers of two from 16 to 1024, then multiples
    of 1024. Few distinct shapes means few per-shape attention plans."""
    if n <= 1024:
        return max(16, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


def gathered_spans(width: int) -> list[int]:
    """The padded spans a chunk of `width` tokens after a cached prefix can attend over, up
    to GATHERED_SPAN_CAP (just the narrowest, where that is wider): each is a pass shape of
    its own."""
    least = max(MIN_PADDED_SPAN, shape_bucket(width + 1))
    spans = [least]
    while spans[-1] * 2 <= GATHERED_SPAN_CAP:
        spans.append(spans[-1] * 2)
    return spans


class ModelRunner:
    def __init__(
        self,
        model: Any,
        storage: KVStorage,
        cache: CacheLayout,
        config: EngineConfig | None = None,
        *,
        max_rows: int,
        max_blocks_per_row: int = 0,
        split_head: bool = False,
        fault_injector: FaultInjector | None = None,
        contain_failures: bool = True,
        adapters: lora.AdapterSet | None = None,
    ) -> None:
        """`cache`: what the model keeps per sequence (service.core.models.layout); `config`:
        how its forwards run (service.core.engine.config, resolved before the runner is
        built); `max_rows`: slots in the row table; `max_blocks_per_row`: the widest block
        table (paged storage); `adapters`: the LoRA adapters installed on the model (None:
        one is made when the first is loaded)."""
        self.model = model
        self.storage = storage
        self.cache = cache
        self.config = config = config or EngineConfig()
        self.states = StateStore(cache.states) if cache.stateful else None
        if storage.name != config.storage:
            raise ValueError(f"the config runs {config.storage} storage, not {storage.name}")
        attends = config.decode_attention == "direct" or config.fast_mirror_attention
        if attends and not paged_attention.install(model):
            raise ValueError("decode attention of our own needs the model's attention function")
        self._fault_injector = fault_injector
        # Redo a failed step row by row, so only the failing rows end. Off under tensor
        # parallel, where the other ranks could not follow the redo.
        self._contain = contain_failures
        self._head = ModelHead(model, split_head)
        self.decode_graph = (
            DecodeGraph(self._head, storage, cache) if config.compile_decode else None
        )
        self.rows: list[Row | None] = [None] * max_rows
        self._parked: dict[str, RowSamplerState] = {}  # preempted rows' samplers, by seq_id
        self.positions = np.zeros(max_rows, np.int32)  # tokens whose K/V are stored, per slot
        self.tables = np.zeros((max_rows, max(1, max_blocks_per_row)), np.int32)
        self.table_lengths = np.zeros(max_rows, np.int32)
        self.plain = np.zeros(max_rows, bool)  # Row.plain, per slot
        self.argmax = np.zeros(max_rows, bool)  # Row.argmax, per slot
        # Rows whose penalties count their tokens (sampled outside the compiled graph).
        self.penalized = np.zeros(max_rows, bool)
        self.constrained = np.zeros(max_rows, bool)  # Row.constrained, per slot
        self.adapters = adapters
        self.adapter_slots = np.zeros(max_rows, np.int32)  # each row's adapter (0: none)
        # Where each row's next input is: the sampled array of step `source_step`, at index.
        self._source_step = np.full(max_rows, -1, np.int64)
        self._source_index = np.zeros(max_rows, np.int32)
        self._sampled_tokens: dict[
            int, mx.array
        ] = {}  # recent forwards' sampled tokens, by forward id
        self._forward_id = 0
        # Compiled decode steps pad to at least this many rows: warm-up sets it to trace each
        # row bucket's graph before requests reach it.
        self.min_rows = 0
        # (rows, width) of the multi-token forwards built so far: a pass is padded only to one.
        self._pass_shapes: set[tuple[int, int]] = set()

    @property
    def batched(self) -> bool:
        return self.config.batched

    @property
    def decode_path(self) -> str:
        return self.config.decode_path

    # -- the plan --------------------------------------------------------------------
    def submit(self, plan: StepPlan, dispatch: bool = True) -> Pending:
        """Apply the plan's changes, run its prefill forwards, build its decode (or
        verification) forward and (unless dispatch=False) queue it. A pending step built with
        dispatch=False is queued by `dispatch`: on storage whose writes are not in place, step
        N+1 must not run while step N still reads the pool."""
        self._apply(plan)
        masks = masks_by_slot(plan.masks)
        prefill = [self._prefill(forward, masks) for forward in plan.prefill]
        pending = Pending(plan, prefill, None)
        if plan.verify:
            pending.verified = self._verify(plan.verify, masks)
        elif plan.decode:
            pending.decode = self._decode(np.asarray(plan.decode, np.int32), dispatch)
        return pending

    def dispatch(self, pending: Pending) -> Pending:
        if pending.decode is not None:
            self._dispatch(pending.decode)
        return pending

    def sample(self, pending: Pending, masks: RowMasks) -> Pending:
        """Sample the decode step's rows that waited for their masks (the step before it has
        been read): each constrained row's logits masked, the batch sampled as any step, and
        queued at once if its forward was."""
        forward = pending.decode
        assert forward is not None, "only a decode step's masks come after its plan"
        staged = forward.staged
        if staged is not None and staged.given is masks and forward.logits is not None:
            self._sample_masked(forward, staged.by_slot, staged)
            return pending
        by_slot = masks_by_slot(masks)
        for part in forward.parts or [forward]:
            if part.logits is not None:
                self._sample_masked(part, by_slot)
        return pending

    def stage_masks(self, pending: Pending, masks: RowMasks) -> None:
        """Make the decode step's token masks ready for `sample(pending, masks)` ahead of it:
        their words in the step's row order, copied to the device. Called from the thread that
        reads the step before while this step is dispatched (the copy is host work that need
        not wait for the dispatch); touches nothing the dispatch reads."""
        forward = pending.decode
        if forward is None or forward.parts is not None or forward.logits is None:
            return
        by_slot = masks_by_slot(masks)
        words = self._mask_words(forward.slots[forward.sampled], by_slot)
        if words is not None:
            forward.staged = _Staged(masks, by_slot, words, upload_words(words))

    def take_prefill(self, pending: Pending) -> StepResult:
        """The step's prefill forwards' results (read already at submit), handed out once: the
        first tokens of the prompts they ended can go out before the decode forward is read."""
        parts, pending.prefill = pending.prefill, []
        result = StepResult.merge(pending.plan.step, parts)
        result.prefill_rows = len(result.slots)
        return result

    def collect(self, pending: Pending) -> StepResult:
        """Read the step's tokens (the evaluation boundary) into one result: the prefill
        forwards' not taken yet, then the decode or verification forward's."""
        prefill_rows = sum(len(p.slots) for p in pending.prefill)
        parts = list(pending.prefill)
        pending.prefill = []
        if pending.verified is not None:
            parts.append(pending.verified)
        elif pending.decode is not None:
            parts.append(self._read(pending.decode))
        result = StepResult.merge(pending.plan.step, parts)
        result.prefill_rows = prefill_rows
        result.decoded = pending.verified is not None or pending.decode is not None
        return result

    def read_beside(self, pending: Pending) -> StepResult | None:
        """`collect`, from a second thread while this runner dispatches the next step (the
        GIL released inside `mx.async_eval`): only a plain decode forward is read there, through
        its readout, which the next step's graph does not reach. None: anything else (rows run
        alone, a redo, a verification, injected faults), which `collect` reads after the
        dispatch."""
        forward = pending.decode
        if (
            pending.prefill
            or pending.verified is not None
            or forward is None
            or forward.readout is None
            or forward.read is not None
            or forward.parts is not None
            or forward.logits is not None
            or self._fault_injector is not None
        ):
            return None
        try:
            result = self._read_plain(forward)
        except Exception:
            return None  # `collect` reads it again and redoes its rows on this thread
        result = StepResult.merge(pending.plan.step, [result])
        result.decoded = True
        return result

    # -- row table -------------------------------------------------------------------
    def _apply(self, plan: StepPlan) -> None:
        for leave in plan.leaves:
            self._leave(leave.slot, leave.final)
        for slot in plan.unload:
            self._unload_adapter(slot)
        for seq_id in plan.forget:
            self._parked.pop(seq_id, None)
        for join in plan.joins:
            self._join(join)
        for slot, table in plan.tables:
            n = len(table)
            if n > self.tables.shape[1]:
                grown = np.zeros((self.tables.shape[0], n), np.int32)
                grown[:, : self.tables.shape[1]] = self.tables
                self.tables = grown
            self.tables[slot, :n] = table
            self.table_lengths[slot] = n
        if plan.capacity or plan.copies:
            self.storage.apply(plan.update)

    def _join(self, join: RowJoin) -> None:
        if self.rows[join.slot] is not None:
            raise ValueError(f"slot {join.slot} is taken")
        if join.num_cached and self.states is not None:
            raise ValueError("a recurrent state cannot be adopted from a cached prefix")
        if join.adapter and (self.adapters is None or self.adapters.name_of(join.adapter) is None):
            raise ValueError(f"adapter slot {join.adapter} holds no adapter")
        sampler = self._parked.pop(join.seq_id, None) if join.resume else None
        if sampler is None:
            sampler = RowSamplerState(join.params, prompt_token_ids=list(join.prompt))
        row = Row(
            join.slot,
            join.seq_id,
            self.storage.new_sequence(),
            sampler,
            join.want_logprobs,
            join.top_logprobs,
            self.states.new_sequence() if self.states is not None else None,
            join.constrained,
        )
        self.rows[join.slot] = row
        self.positions[join.slot] = join.num_cached
        self.table_lengths[join.slot] = 0
        self.plain[join.slot] = row.plain
        self.argmax[join.slot] = row.argmax
        self.penalized[join.slot] = not self.plain[join.slot] and sampler.params.has_penalties
        self.constrained[join.slot] = join.constrained
        self.adapter_slots[join.slot] = join.adapter
        self._source_step[join.slot] = -1

    def _leave(self, slot: int, final: bool) -> None:
        row = self.rows[slot]
        if row is None:
            raise ValueError(f"slot {slot} is empty")
        self.storage.release(row.kv)
        if row.state is not None and self.states is not None:
            self.states.release(row.state)
        if not final:
            self._parked[row.seq_id] = row.sampler
        else:
            self._parked.pop(row.seq_id, None)
        self.rows[slot] = None
        self.positions[slot] = 0
        self.constrained[slot] = False
        self.penalized[slot] = False
        self.adapter_slots[slot] = 0
        self._source_step[slot] = -1

    # -- forwards --------------------------------------------------------------------
    def _prefill(self, chunks: list[Chunk], masks: Masks) -> StepResult:
        """One prefill forward, read at once (constrained rows that sample under `masks`)."""
        if not self.batched and len(chunks) > 1:
            raise ValueError("this runner runs one row per forward (per-row path)")
        if self.config.single_row_prefill and len(chunks) > 1:
            raise ValueError("a recurrent model's multi-token forward carries one row")
        slots = np.asarray([c.slot for c in chunks], np.int32)
        inputs: list[list[int] | None] = [list(c.tokens) for c in chunks]
        samples = np.asarray([c.sample for c in chunks], bool)
        unmasked = [s for s in slots[samples].tolist() if self.constrained[s] and s not in masks]
        if unmasked:
            raise ValueError(f"constrained rows {unmasked} sample with no token mask")
        started = time.perf_counter()
        forward = self._build(slots, inputs, samples, masks)
        redone = forward.read is not None
        result = self._read(self._dispatch(forward))
        # A forward redone row by row says nothing about the cost of one: NaN.
        seconds = float("nan") if redone or result.errors else time.perf_counter() - started
        result.prefill_seconds = [seconds]
        return result

    def _decode(self, slots: np.ndarray, dispatch: bool) -> _Forward:
        # Rows in the storage's order (the CPU mirror keeps each row where it holds it);
        # results are by slot, so the order is the runner's own.
        slots = self.storage.decode_order(slots)
        if not self.batched and len(slots) > 1:
            # The per-row path: each row alone, read at once (or at collect, with the
            # constrained rows' masks).
            forward = self._rows_alone(slots, [None] * len(slots), None, None)
            return self._dispatch(forward) if dispatch else forward
        forward = self._build(slots, [None] * len(slots), None, None)
        return self._dispatch(forward) if dispatch else forward

    def _build(
        self,
        slots: np.ndarray,
        inputs: list[list[int] | None],
        samples: np.ndarray | None,
        masks: Masks | None,
    ) -> _Forward:
        """Build one forward; rows fed None take their last sampled token. `samples`: which
        rows sample (None: all). `masks`: the constrained rows' (None: not known yet, they
        stop at their logits until `sample`). A build that raises runs its rows one by one."""
        try:
            return self._build_batch(slots, inputs, samples, masks)
        except (SlotsNotReservedError, EmptySlotError):
            raise  # the scheduler's bug, not the rows': nothing to contain
        except Exception as exc:
            if not self._contain:
                raise
            if len(slots) == 1:
                log.warning(
                    "building a forward failed",
                    request_id=self._row(slots[0]).seq_id,
                    error=str(exc),
                )
                forward = _Forward(slots, [], np.ones(1, np.int32), np.zeros(0, np.int32), None)
                forward.read = StepResult.empty(-1)
                forward.read.errors[int(slots[0])] = BACKEND_ERROR
                return forward
            log.warning(
                "building a batched forward failed; running its rows one by one", error=str(exc)
            )
            return self._rows_alone(slots, inputs, samples, masks)

    def _layout(
        self, slots: np.ndarray, rows: list[Row], starts: np.ndarray, lengths: np.ndarray
    ) -> StepLayout:
        """The rows' places in the storage for one forward, from the row table."""
        widest = max(1, int(self.table_lengths[slots].max()))
        return StepLayout(
            [r.kv for r in rows],
            starts,
            lengths,
            self.tables[slots, :widest],
            self.table_lengths[slots],
            slots,
        )

    def _build_batch(
        self,
        slots: np.ndarray,
        inputs: list[list[int] | None],
        samples: np.ndarray | None,
        masks: Masks | None,
    ) -> _Forward:
        rows = self._rows_of(slots)
        prompt = inputs.count(None) < len(inputs)  # C-speed: a decode step has hundreds of rows
        if not prompt:
            lengths = np.ones(len(slots), np.int32)
        else:
            lengths = np.asarray([1 if x is None else len(x) for x in inputs], np.int32)
            if lengths.min() < 1:
                raise ValueError("a step row needs at least one token")
        starts = self.positions[slots].copy()
        layout = self._layout(slots, rows, starts, lengths)
        width = int(lengths.max())
        if self.config.shape_buckets and width > 1:
            layout.pad_width = shape_bucket(width)
            span = shape_bucket(int((starts + lengths).max()))
            layout.pad_span = max(span, MIN_PADDED_SPAN)
        tokens = self._input_tokens(slots, inputs, layout.width, prompt)  # [B, N]
        decode = layout.width == 1
        sampled = (
            np.arange(len(slots), dtype=np.int32)
            if samples is None
            else np.flatnonzero(samples).astype(np.int32)
        )
        states = self.states.begin([r.state for r in rows]) if self.states is not None else None
        adapters = self.adapter_slots[slots]
        last_logits: mx.array | None = None
        hidden: mx.array | None = None
        if decode and self.decode_graph is not None and len(sampled) == len(rows):
            graph_adapters = adapters if adapters.any() else None
            if self.plain[slots].all():
                drawn = self.decode_graph.logits(  # [B]
                    tokens, layout, True, self.min_rows, graph_adapters
                )
                self.positions[slots] += lengths
                forward = self._sampled(slots, sampled, rows, drawn)
                forward.lengths, forward.inputs = lengths, inputs
                return forward
            last_logits = self.decode_graph.logits(
                tokens, layout, False, self.min_rows, graph_adapters
            )
        else:
            pad = self._padding_rows(layout) if states is None else 0
            run, run_tokens, run_adapters = layout, tokens, adapters
            if pad:
                run = layout.padded_rows(pad)
                run_tokens = mx.concatenate([tokens, mx.repeat(tokens[-1:], pad, axis=0)])
                run_adapters = np.concatenate([adapters, np.repeat(adapters[-1:], pad)])
            views = self.storage.views(
                run, self.cache, states, self.config.grouped_query_mask, prompt=prompt
            )
            if run.width > 1:
                self._pass_shapes.add((run.batch_size, run.width))
            self._check_faults(rows, "build")
            row_lengths = rope.ROW_LENGTHS.set(run.lengths.tolist())
            try:
                # [B, N, H] (logits if not split)
                hidden = self._head.hidden(run_tokens, views, self._adapter_rows(run_adapters))
                self.storage.end_forward()
            finally:
                rope.ROW_LENGTHS.reset(row_lengths)
            if pad:
                hidden = hidden[: len(slots)]
        if states is not None:
            states.commit()
        self.positions[slots] += lengths
        undo = states.undo if states is not None else None
        if last_logits is None:
            if not len(sampled):
                # Evaluating the last hidden state forces every layer's K/V write.
                return _Forward(
                    slots, rows, lengths, sampled, None, hidden=hidden, undo=undo, inputs=inputs
                )
            assert hidden is not None
            if decode:
                last_hidden = (
                    hidden[:, 0] if len(sampled) == len(rows) else hidden[mx.array(sampled), 0]
                )
            else:
                last = mx.array(lengths[sampled] - 1)
                last_hidden = hidden[mx.array(sampled), last]  # [S, H]
            # [S, V]
            last_logits = self._head.logits(last_hidden, self._adapter_rows(adapters[sampled]))
        if masks is None and self.constrained[slots[sampled]].any():
            forward = _Forward(slots, rows, lengths, sampled, None, logits=last_logits)
        else:
            words = self._mask_words(slots[sampled], masks)
            forward = self._sample(slots, sampled, rows, last_logits, words)
            forward.masks = masks
        forward.lengths, forward.undo, forward.inputs = lengths, undo, inputs
        return forward

    def _padding_rows(self, layout: StepLayout) -> int:
        """Rows to add to a multi-token forward on paged storage with shape buckets: up to the
        next power of two of rows, where a pass of that shape has run before (the warm-up builds
        them: service.core.warm_up). Padding rows cost the device little next to a new shape's
        build, and the pass's memory is bounded by one that already ran. Not where the model
        runs whole (its logits at every position would double with the rows)."""
        b = layout.batch_size
        if not (self.config.shape_buckets and self.config.paged and self._head.split):
            return 0
        if b < 2 or layout.width < 2:
            return 0
        target = 1 << (b - 1).bit_length()
        return target - b if (target, layout.width) in self._pass_shapes else 0

    def _masked(
        self,
        logits: mx.array,
        slots: np.ndarray,
        masks: Masks | None,
        positions: np.ndarray | None = None,
    ) -> mx.array:
        """The logits with the constrained rows' masks applied (one op for the batch);
        unchanged when none of the slots is constrained."""
        words = self._mask_words(slots, masks, positions)
        return logits if words is None else apply_token_masks(logits, words)

    def _mask_words(
        self, slots: np.ndarray, masks: Masks | None, positions: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The batch's token bitmask: one row per slot, or `positions[i]` consecutive rows for
        slots[i] (a verification); all ones for a row without a mask. None when none of the
        slots is constrained."""
        if not masks or not self.constrained[slots].any():
            return None
        width = next(iter(masks.values())).shape[1]
        if positions is None:
            given = [masks.get(slot) for slot in slots.tolist()]
            if all(rows is not None for rows in given):
                return np.concatenate([rows[:1] for rows in given])
        counts = np.ones(len(slots), np.int64) if positions is None else positions
        words = np.full((int(counts.sum()), width), -1, np.int32)
        offset = 0
        for slot, n in zip(slots.tolist(), counts.tolist()):
            rows = masks.get(slot)
            if rows is not None:
                words[offset : offset + n] = rows[:n]
            offset += n
        return words

    def _sample_masked(
        self,
        forward: _Forward,
        masks: Masks,
        staged: _Staged | None = None,
    ) -> None:
        """Sample a forward whose constrained rows waited for their masks (made ready already
        where `staged`)."""
        assert forward.logits is not None
        uploaded = None
        if staged is not None:
            words, uploaded = staged.words, staged.uploaded
        else:
            words = self._mask_words(forward.slots[forward.sampled], masks)
        done = self._sample(
            forward.slots, forward.sampled, forward.rows, forward.logits, words, uploaded
        )
        forward.staged = None
        forward.tokens, forward.logprobs, forward.top = done.tokens, done.logprobs, done.top
        forward.readout = done.readout
        forward.sources, forward.logits, forward.masks = done.sources, None, masks
        if forward.dispatched:
            self._dispatch(forward)

    def _sample(
        self,
        slots: np.ndarray,
        sampled: np.ndarray,
        rows: list[Row],
        logits: mx.array,
        words: np.ndarray | None = None,
        uploaded: mx.array | None = None,
    ) -> _Forward:
        """Draw the sampled rows' tokens from their logits, under the token masks `words` (one
        row per sampled row; `uploaded`: on the device already) where given."""
        sampled_slots = slots[sampled]
        if self.argmax[sampled_slots].all():
            if words is None:
                drawn = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                drawn = masked_argmax(logits, words, uploaded)
            logprobs = top = None
        else:
            if words is not None:
                logits = apply_token_masks(logits, words, uploaded)
            picked = [rows[i] for i in sampled]
            drawn, processed = sample(logits, [r.sampler for r in picked])
            logprobs = top = None
            if any(r.want_logprobs for r in picked):
                all_lp = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
                logprobs = mx.take_along_axis(all_lp, drawn[:, None], axis=-1)[:, 0]
                k = max(r.top_logprobs for r in picked)
                if k > 0:
                    top_ids = mx.argsort(-all_lp, axis=-1)[:, :k]
                    top = (top_ids, mx.take_along_axis(all_lp, top_ids, axis=-1))
        return self._sampled(slots, sampled, rows, drawn, logprobs, top)

    def _sampled(
        self,
        slots: np.ndarray,
        sampled: np.ndarray,
        rows: list[Row],
        drawn: mx.array,
        logprobs: mx.array | None = None,
        top: tuple[mx.array, mx.array] | None = None,
    ) -> _Forward:
        """A forward that drew `drawn` for its sampled rows: their next inputs."""
        sampled_slots = slots[sampled]
        fid = self._next_forward_id()
        self._sampled_tokens[fid] = drawn
        sources = (self._source_step[sampled_slots], self._source_index[sampled_slots])
        self._source_step[sampled_slots] = fid
        self._source_index[sampled_slots] = np.arange(len(sampled), dtype=np.int32)
        forward = _Forward(
            slots, rows, np.ones(len(slots), np.int32), sampled, drawn, logprobs, top
        )
        forward.sources = sources
        if self.config.update_beside_dispatch:
            forward.readout = mx.stop_gradient(drawn)  # shares the buffer: no kernel
        return forward

    def _next_forward_id(self) -> int:
        self._forward_id += 1
        # Only the last few forwards' tokens can still be a row's next input.
        for old in [k for k in self._sampled_tokens if k < self._forward_id - 4]:
            live = self._source_step == old
            if not live.any():
                del self._sampled_tokens[old]
        return self._forward_id

    def _input_tokens(
        self, slots: np.ndarray, inputs: list[list[int] | None], width: int, prompt: bool
    ) -> mx.array:
        """The step's [B, width] input ids. Decode rows take the token their last forward
        sampled; when every row feeds from one forward in its order (the steady state), that
        array is the input as it is. `prompt`: some row feeds prompt tokens."""
        if not prompt:
            sources = self._source_step[slots]
            if (sources < 0).any():
                missing = self._row(slots[int(np.argmax(sources < 0))]).seq_id
                raise ValueError(f"sequence {missing} has no sampled token to feed")
            index = self._source_index[slots]
            first = int(sources[0])
            if (sources == first).all():
                source = self._sampled_tokens[first]
                if len(index) != source.shape[0] or (index != np.arange(len(index))).any():
                    source = source[mx.array(index)]
                return source.astype(mx.int32)[:, None]
            return self._gather_tokens(sources, index)[:, None]
        rows = []
        for slot, x in zip(slots, inputs):
            if x is None:
                source = self._sampled_tokens[int(self._source_step[slot])]
                j = int(self._source_index[slot])
                token = source[j : j + 1].astype(mx.int32)
                rows.append(
                    token if width == 1 else mx.concatenate([token, mx.zeros(width - 1, mx.int32)])
                )
            else:
                rows.append(mx.array(x + [0] * (width - len(x)), dtype=mx.int32))
        return mx.stack(rows)

    def _gather_tokens(self, sources: np.ndarray, index: np.ndarray) -> mx.array:
        """Tokens sampled by several forwards (e.g. rows whose prefill just ended beside rows
        that decoded): one concatenation and one take."""
        ids = sorted(set(int(s) for s in sources))
        offsets, arrays, total = {}, [], 0
        for fid in ids:
            offsets[fid] = total
            arrays.append(self._sampled_tokens[fid])
            total += self._sampled_tokens[fid].shape[0]
        flat = np.asarray([offsets[int(s)] for s in sources], np.int32) + index
        return mx.concatenate(arrays)[mx.array(flat)].astype(mx.int32)

    def _dispatch(self, forward: _Forward) -> _Forward:
        if forward.read is None:
            forward.dispatched = True
            if forward.parts is not None:
                for part in forward.parts:
                    self._dispatch(part)
            elif forward.logits is not None:
                mx.async_eval(forward.logits)  # its masks are filled meanwhile
            elif forward.tokens is None:
                mx.async_eval(forward.hidden)
            else:
                extra = (forward.readout, forward.logprobs, *(forward.top or ()))
                mx.async_eval([forward.tokens, *(x for x in extra if x is not None)])
        return forward

    def _read(self, forward: _Forward) -> StepResult:
        """Read a forward's sampled tokens; a failure reruns its rows one by one."""
        if forward.read is not None:
            return forward.read
        if forward.parts is not None:
            return StepResult.merge(-1, [self._read(part) for part in forward.parts])
        if forward.logits is not None:
            raise RuntimeError("a step with constrained rows was read before its masks came")
        try:
            if forward.tokens is None:
                mx.eval(forward.hidden)
                return StepResult.empty(-1)
            return self._read_plain(forward)
        except Exception as exc:
            if not self._contain:
                raise
            log.warning("batched evaluation failed; retrying rows one by one", error=str(exc))
            return self._redo_alone(forward)

    def _read_plain(self, forward: _Forward) -> StepResult:
        """A sampled forward's tokens (and logprobs) on the host; raises where its evaluation
        failed."""
        if self._fault_injector is not None:
            self._check_faults([forward.rows[i] for i in forward.sampled], "evaluate")
        tokens = np.asarray(
            forward.tokens if forward.readout is None else forward.readout, dtype=np.int32
        )
        result = StepResult(-1, forward.slots[forward.sampled], tokens)
        if forward.logprobs is not None:
            result.logprobs = np.asarray(forward.logprobs, dtype=np.float32)
            if forward.top is not None:
                result.top_ids = np.asarray(forward.top[0], dtype=np.int32)
                result.top_logprobs = np.asarray(forward.top[1], dtype=np.float32)
        self._record(forward, tokens)
        return result

    def _record(self, forward: _Forward, tokens: np.ndarray) -> None:
        """Token counts for the rows whose penalties read them (no walk over the others)."""
        penalized = self.penalized[forward.slots[forward.sampled]]
        for j in np.flatnonzero(penalized).tolist():
            forward.rows[int(forward.sampled[j])].sampler.record(int(tokens[j]))

    # -- failures ----------------------------------------------------------------------
    def _rows_alone(
        self,
        slots: np.ndarray,
        inputs: list[list[int] | None],
        samples: np.ndarray | None,
        masks: Masks | None,
    ) -> _Forward:
        """Run each row as its own forward (the per-row path, or after a batched build failed)
        and read it now; constrained rows still waiting for their masks are read at collect
        with the others."""
        forward = _Forward(slots, [], np.ones(len(slots), np.int32), np.zeros(0, np.int32), None)
        waits = masks is None and bool(self.constrained[slots].any())
        parts = []
        for i, slot in enumerate(slots):
            one = np.asarray([slot], np.int32)
            sample_one = None if samples is None else samples[i : i + 1]
            part = self._build(one, [inputs[i]], sample_one, masks)
            parts.append(part if waits else self._read(self._dispatch(part)))
        if waits:
            forward.parts = parts
        else:
            forward.read = StepResult.merge(-1, parts)
        return forward

    def _redo_alone(self, forward: _Forward) -> StepResult:
        """Redo a failed forward per row, so a failure ends only the rows that really fail.
        Its K/V writes are redone by the retries; its recurrent states are put back."""
        if self.config.native_caches:
            # mlx-lm's caches appended the step already: a redo would append it twice.
            result = StepResult.empty(-1)
            result.errors = {int(s): BACKEND_ERROR for s in forward.slots}
            return result
        if forward.undo is not None and self.states is not None:
            self.states.undo(forward.undo)
        self.positions[forward.slots] -= forward.lengths
        if forward.sources is not None:
            sampled_slots = forward.slots[forward.sampled]
            self._source_step[sampled_slots], self._source_index[sampled_slots] = forward.sources
        sampling = set(forward.sampled.tolist())
        parts = []
        for i, slot in enumerate(forward.slots):
            row = forward.rows[i]
            if self.rows[int(slot)] is not row:
                continue  # it left since: nothing to redo
            try:
                if self._fault_injector is not None and self._fault_injector(row, "evaluate"):
                    raise EngineError(f"injected evaluate fault for {row.seq_id}")
                one = np.asarray([slot], np.int32)
                sample_one = np.asarray([i in sampling])
                rebuilt = self._build(one, [forward.inputs[i]], sample_one, forward.masks or {})
                part = self._read(self._dispatch(rebuilt))
            except Exception as exc:
                log.warning("row evaluation failed", request_id=row.seq_id, error=str(exc))
                part = StepResult.empty(-1)
                part.errors[int(slot)] = BACKEND_ERROR
            parts.append(part)
        return StepResult.merge(-1, parts)

    def _check_faults(self, rows: list[Row], stage: str) -> None:
        if self._fault_injector is None:
            return
        for row in rows:
            if self._fault_injector(row, stage):
                raise EngineError(f"injected {stage} fault for {row.seq_id}")

    def _row(self, slot: int | np.integer) -> Row:
        row = self.rows[int(slot)]
        if row is None:
            raise EmptySlotError(f"slot {slot} runs with no row in it")
        return row

    def _rows_of(self, slots: np.ndarray) -> list[Row]:
        """The rows of a forward's slots (one list lookup a row: a decode step has hundreds)."""
        table = self.rows
        rows = [table[s] for s in slots.tolist()]
        if None in rows:
            self._row(slots[rows.index(None)])  # raises EmptySlotError, naming the slot
        return rows

    # -- LoRA adapters ---------------------------------------------------------------
    def _adapter_rows(self, adapters: np.ndarray) -> lora.RowAdapters | None:
        """What a forward's rows publish: their adapter slots, or None when no row has one (the
        wrappers are then the base layers alone)."""
        if self.adapters is None or not adapters.any():
            return None
        return self.adapters.rows(adapters)

    def load_adapter(self, name: str, path: str, slot: int) -> AdapterDescription:
        """Read, check and install an adapter in `slot` (between steps); raises AdapterError
        with the reason when it cannot be served."""
        adapter = lora.load_adapter(name, path, self.model)
        if self.adapters is None:
            self.adapters = lora.AdapterSet(self.model, kernel=self.config.lora_kernel)
        self.adapters.add(adapter, slot)
        del adapter  # its tensors now live in the stacks alone
        release_freed_memory()
        if self.decode_graph is not None:
            self.decode_graph.reset()  # the traced graphs hold the stacks as they were
        return self.adapters.describe(name)

    def _unload_adapter(self, slot: int) -> None:
        if self.adapters is None:
            raise ValueError(f"adapter slot {slot} holds no adapter")
        name = self.adapters.name_of(slot)
        if name is None:
            raise ValueError(f"adapter slot {slot} holds no adapter")
        if (self.adapter_slots[[r.slot for r in self.rows if r is not None]] == slot).any():
            raise ValueError(f"adapter {name!r} is unloaded while a row uses it")
        self.adapters.remove(name)
        release_freed_memory()
        if self.decode_graph is not None:
            self.decode_graph.reset()

    # -- speculative decoding ----------------------------------------------------------
    def _verify(self, drafts: list[Draft], masks: Masks) -> StepResult:
        """One forward over each row's last token and drafted tokens (rows with no draft take
        a plain decode step in it); each row keeps the drafts the model agrees with plus one
        token of its own (sampler.verify_draft). The rejected positions' K/V is left behind:
        each row's position stops before it, and the scheduler gives their slots back. Read at
        once: the next step depends on how much was accepted."""
        if self.states is not None or self.config.native_caches:
            raise ValueError("speculative decoding needs attention caches that can roll back")
        slots = np.asarray([d.slot for d in drafts], np.int32)
        rows = [self._row(s) for s in slots]
        last_tokens = self._last_tokens(slots)
        inputs = [[last, *d.tokens] for last, d in zip(last_tokens, drafts)]
        lengths = np.asarray([len(x) for x in inputs], np.int32)
        starts = self.positions[slots].copy()
        greedy = bool(self.plain[slots].all())  # never with a constrained row: it is not plain
        if self.decode_graph is not None:
            out = self._verify_as_decode(slots, rows, inputs, lengths, starts, greedy)
        else:
            out = self._verify_gathered(slots, rows, inputs, lengths, starts)
            greedy = False
        if not greedy:  # each constrained row's positions under its validated draft's masks
            out = self._masked(out, slots, masks, lengths)
        mx.eval(out)
        targets = np.asarray(out, dtype=np.int32) if greedy else None
        logits = None if greedy else out
        emitted_all: list[int] = []
        counts, drafted, lps = [], [], []
        offset = 0
        for row, start, n, d in zip(rows, starts, lengths, drafts):
            if targets is not None:
                emitted, processed = _accept_greedy(targets[offset : offset + n], d.tokens), None
            else:
                assert logits is not None
                emitted, processed = verify_draft(
                    logits[offset : offset + n], d.tokens, row.sampler
                )
            offset += int(n)
            accepted = len(emitted) - 1
            # Valid K/V: the last token and the accepted drafts; the last emitted token is the
            # next step's input.
            self.positions[row.slot] = int(start) + accepted + 1
            fid = self._next_forward_id()
            self._sampled_tokens[fid] = mx.array([emitted[-1]], dtype=mx.int32)
            self._source_step[row.slot], self._source_index[row.slot] = fid, 0
            if row.want_logprobs and processed is not None:
                lp = processed[: len(emitted)] - mx.logsumexp(
                    processed[: len(emitted)], axis=-1, keepdims=True
                )
                lps.extend(lp[j, t].item() for j, t in enumerate(emitted))
            else:
                lps.extend([0.0] * len(emitted))
            for token in emitted:
                row.sampler.record(token)
            emitted_all.extend(emitted)
            counts.append(len(emitted))
            drafted.append(len(d.tokens))
        result = StepResult(
            -1,
            slots,
            np.asarray(emitted_all, np.int32),
            counts=np.asarray(counts, np.int32),
            drafted=np.asarray(drafted, np.int32),
        )
        if any(r.want_logprobs for r in rows):
            result.logprobs = np.asarray(lps, np.float32)
        return result

    def _verify_as_decode(
        self,
        slots: np.ndarray,
        rows: list[Row],
        inputs: list[list[int]],
        lengths: np.ndarray,
        starts: np.ndarray,
        greedy: bool,
    ) -> mx.array:
        """A verification forward as a decode step of one virtual row per position (CUDA):
        a transformer treats positions alone except in attention, and there each layer writes
        every position's K/V before any reads it, so position j of a row sees the draft tokens
        before it. The shape is a decode step's, replayed from the compiled graph like one.
        Returns the argmax tokens per position (greedy) or the logits."""
        virtual = np.repeat(slots, lengths)
        offsets = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
        index = np.repeat(np.arange(len(slots)), lengths)
        layout = StepLayout(
            [rows[i].kv for i in index],
            np.repeat(starts, lengths) + offsets,
            np.ones(len(virtual), np.int32),
            self.tables[virtual, : max(1, int(self.table_lengths[slots].max()))],
            self.table_lengths[virtual],
            virtual,
        )
        tokens = mx.array(np.concatenate(inputs).astype(np.int32))[:, None]
        assert self.decode_graph is not None
        adapters = self.adapter_slots[virtual]  # each position with its row's adapter
        graph_adapters = adapters if adapters.any() else None
        return self.decode_graph.logits(tokens, layout, greedy, self.min_rows, graph_adapters)

    def _verify_gathered(
        self,
        slots: np.ndarray,
        rows: list[Row],
        inputs: list[list[int]],
        lengths: np.ndarray,
        starts: np.ndarray,
    ) -> mx.array:
        """A verification forward over K/V gathered from the storage: every position's
        logits, [sum(lengths), V]."""
        layout = self._layout(slots, rows, starts, lengths)
        width = layout.width
        tokens = mx.array([x + [0] * (width - len(x)) for x in inputs], dtype=mx.int32)
        views = self.storage.views(
            layout, self.cache, None, self.config.grouped_query_mask, gather=True
        )
        adapters = self.adapter_slots[slots]
        hidden = self._head.hidden(tokens, views, self._adapter_rows(adapters))  # [B, N, H]
        row_idx = mx.array(np.repeat(np.arange(len(slots)), lengths))
        col_idx = mx.array(np.concatenate([np.arange(n) for n in lengths]))
        # Each position with its row's adapter.
        positions = self._adapter_rows(np.repeat(adapters, lengths))
        return self._head.logits(hidden[row_idx, col_idx], positions)

    def _last_tokens(self, slots: np.ndarray) -> list[int]:
        """The rows' last sampled tokens, read (a verification forward needs them as ids)."""
        out = []
        for slot in slots:
            fid = int(self._source_step[slot])
            if fid < 0:
                raise ValueError(f"sequence {self._row(slot).seq_id} has no sampled token")
            out.append(int(self._sampled_tokens[fid][int(self._source_index[slot])].item()))
        return out


def _accept_greedy(targets: np.ndarray, draft: list[int]) -> list[int]:
    """Greedy verification: drafts are kept while each is the model's own next token, then
    the model's token where they part (or after the last draft): plain greedy decoding's."""
    out: list[int] = []
    for j, token in enumerate(draft):
        if int(targets[j]) != token:
            break
        out.append(token)
    out.append(int(targets[len(out)]))
    return out


class ModelHead:
    """Splits a model into its trunk and its LM head, so only the rows' last positions are
    projected to the vocabulary (a 2048-token prefill would otherwise spend most of its time
    in the head). Families whose head is not a plain projection (service.core.models.families)
    run whole and we slice the logits."""

    def __init__(self, model: Any, split: bool) -> None:
        self._model = model
        self.split = split

    def hidden(
        self, tokens: mx.array, views: list, adapters: lora.RowAdapters | None = None
    ) -> mx.array:
        """`adapters`: the rows' LoRA adapters (service.core.models.lora)."""
        with lora.use_adapters(adapters):
            if self.split:
                return self._model.model(tokens, cache=views)
            return self._model(tokens, cache=views)

    def logits(self, hidden: mx.array, adapters: lora.RowAdapters | None = None) -> mx.array:
        """`adapters`: one per row of `hidden` (an adapter may target the LM head)."""
        if not self.split:
            return hidden  # already logits
        model = self._model
        with lora.use_adapters(adapters):
            if "lm_head" in model:  # tied models have none (mlx-lm creates or drops it)
                return model.lm_head(hidden)
            return model.model.embed_tokens.as_linear(hidden)
