"""Scheduler tests without a model: a fake runner that turns each step plan into its result
(deterministically: the next token is the last input + 1), and a harness that runs the real
scheduler and core loop on it one step at a time, recording what each request received.

The scheduler never calls the fake: the loop hands it the scheduler's plans and feeds its
results back, as it does with the model runner.

Rows with a response format sample under the masks the plan or `sample` brings: what `steer`
picks among the allowed tokens, or without one the fake's own token when the mask allows it,
else the lowest allowed. A constrained decode step read before its masks came fails, as the
runner's does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from service.common.grammar import Compiled
from service.common.model_source import ModelLoadError
from service.core.engine.config import EngineConfig
from service.core.kv.block_pool import KVCacheManager, KVManager, UnpagedKV
from service.core.loop import CoreLoop
from service.core.scheduler.adapters import AdapterTable
from service.core.scheduler.constraints import Constraints
from service.core.scheduler.plan import RowMasks, StepPlan, StepResult
from service.core.scheduler.request import Request
from service.core.scheduler.scheduler import Scheduler, SchedulerConfig
from service.protocol import AdapterDescription, Event, Final, GenerationRequest, Outputs

VOCAB = 1000
EOS = 999


@dataclass
class Forward:
    """One forward of a plan: per row, the request id and the tokens fed (None: decode)."""

    rows: list[tuple[str, list[int] | None]]

    @property
    def is_decode(self) -> bool:
        return all(tokens is None for _, tokens in self.rows)

    @property
    def ids(self) -> list[str]:
        return [seq_id for seq_id, _ in self.rows]


@dataclass
class FakeClock:
    """Seconds that pass only when the fake runner's forwards are read."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


# Seconds of one forward from its rows: (tokens fed, or None for a decode row; tokens cached).
ForwardCost = Callable[[list[tuple[int | None, int]]], float]


def flat_cost(rows: list[tuple[int | None, int]]) -> float:
    """The default: 10 ms a forward plus 10 us a prompt token, whatever the context."""
    return 0.010 + 1e-5 * sum(n or 0 for n, _ in rows)


# Steers a constrained row: (request_id, the position in this step (a verification's k-th
# draft), its own token, the allowed tokens) -> the token.
Steer = Callable[[str, int, int, np.ndarray], int]


def allowed_tokens(words: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row (int32 words, llguidance's layout) allows."""
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))


@dataclass
class _Row:
    request_id: str
    position: int = 0
    last: int | None = None  # the last token sampled (the next decode step's input)
    table: int = 0  # blocks in its table
    constrained: bool = False


@dataclass
class _Pending:
    plan: StepPlan
    prefill: list[StepResult]
    decode: StepResult | None
    seconds: float
    waiting: bool = False  # constrained decode rows wait for their masks


@dataclass
class FakeRunner:
    """What the loop calls on a runner; each plan's result is made when it is submitted and
    handed out when it is read. `block_size`: check each row's positions against its table."""

    config: EngineConfig = field(default_factory=EngineConfig)
    clock: FakeClock = field(default_factory=FakeClock)
    cost: ForwardCost | None = None
    forwards: list[Forward] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)
    block_size: int | None = None
    rows: dict[int, _Row] = field(default_factory=dict)
    steer: Steer | None = None
    # What happened, in order: ("collect", step), ("sample", step, slots).
    calls: list[tuple] = field(default_factory=list)
    adapter_of: dict[str, int] = field(default_factory=dict)  # request id -> adapter slot joined
    adapters: dict[int, str] = field(default_factory=dict)  # loaded: slot -> name
    # The threads that read steps beside a dispatch (read_beside), one entry per step read.
    beside_threads: list[str] = field(default_factory=list)
    staged_threads: list[str] = field(default_factory=list)  # where stage_masks ran

    @property
    def live(self) -> set[str]:
        return {r.request_id for r in self.rows.values()}

    def submit(self, plan: StepPlan, dispatch: bool = True) -> _Pending:
        self.plans.append(plan)
        for leave in plan.leaves:
            self.released.append(self.rows.pop(leave.slot).request_id)
        for slot in plan.unload:
            users = [r for r in self.rows.values() if self.adapter_of.get(r.request_id) == slot]
            assert not users, f"adapter slot {slot} unloaded while {users} use it"
            del self.adapters[slot]
        for join in plan.joins:
            assert join.slot not in self.rows, f"slot {join.slot} is taken"
            assert not join.adapter or join.adapter in self.adapters, "no such adapter"
            request_id = join.seq_id.split("#")[0]
            self.added.append(request_id)
            self.adapter_of[request_id] = join.adapter
            self.rows[join.slot] = _Row(request_id, join.num_cached, constrained=join.constrained)
        for slot, table in plan.tables:
            self.rows[slot].table = len(table)
        seconds = 0.0
        prefill = []
        for chunks in plan.prefill:
            if not self.config.batched:
                assert len(chunks) == 1
            shapes = [(len(c.tokens), self.rows[c.slot].position) for c in chunks]
            seconds_here = self.cost(list(shapes)) if self.cost is not None else 0.0
            seconds += seconds_here
            self.forwards.append(
                Forward([(self.rows[c.slot].request_id, c.tokens) for c in chunks])
            )
            sampled = [(c.slot, self._feed(c.slot, c.tokens)) for c in chunks if c.sample]
            sampled = [(slot, self._masked(slot, t, plan.masks, 0)) for slot, t in sampled]
            for c in chunks:
                if not c.sample:
                    self._advance(c.slot, len(c.tokens))
            result = _result(sampled)
            result.prefill_seconds = [seconds_here]
            prefill.append(result)
        decode = None
        if plan.verify:
            decode = self._verify(plan)
        elif plan.decode:
            rows = [self.rows[s] for s in plan.decode]
            shapes = [(None, r.position) for r in rows]
            seconds += self.cost(list(shapes)) if self.cost is not None else 0.0
            self.forwards.append(Forward([(r.request_id, None) for r in rows]))
            inputs = []
            for slot, row in zip(plan.decode, rows):
                assert row.last is not None, f"{row.request_id} has no token to feed"
                inputs.append((slot, self._feed(slot, [row.last])))
            decode = _result(inputs)
        waiting = any(self.rows[s].constrained for s in plan.decode)
        return _Pending(plan, prefill, decode, seconds, waiting)

    def stage_masks(self, pending: _Pending, masks: RowMasks) -> None:
        assert pending.waiting and pending.decode is not None, "nothing waits for masks"
        self.calls.append(("stage", pending.plan.step, list(masks.slots)))
        self.staged_threads.append(threading.current_thread().name)

    def sample(self, pending: _Pending, masks: RowMasks) -> _Pending:
        assert pending.waiting and pending.decode is not None, "nothing waits for masks"
        self.calls.append(("sample", pending.plan.step, list(masks.slots)))
        tokens = pending.decode.tokens
        for i, slot in enumerate(pending.decode.slots.tolist()):
            if slot in self.rows:
                tokens[i] = self._masked(slot, int(tokens[i]), masks, 0)
        pending.waiting = False
        return pending

    def _masked(self, slot: int, token: int, masks: RowMasks | None, position: int) -> int:
        """A row's token under its mask at one of its positions in `masks` (none: as is)."""
        row = self.rows[slot]
        if not row.constrained or masks is None or slot not in masks.slots:
            return token
        words = masks.array()[masks.slots.index(slot) + position]
        allowed = allowed_tokens(words)
        if self.steer is not None:
            token = self.steer(row.request_id, position, token, allowed)
        elif token not in allowed:
            token = int(allowed[0])
        assert token in allowed, f"{row.request_id}: token {token} is not allowed"
        row.last = token
        return token

    def _feed(self, slot: int, tokens: list[int]) -> int:
        """Feed tokens to a row; the token it samples after them."""
        self._advance(slot, len(tokens))
        token = (tokens[-1] + 1) % VOCAB
        self.rows[slot].last = token
        return token

    def _advance(self, slot: int, n: int) -> None:
        row = self.rows[slot]
        row.position += n
        if self.block_size is not None:
            assert row.position <= row.table * self.block_size, f"{row.request_id}: no slots"

    def _verify(self, plan: StepPlan) -> StepResult:
        """Drafts are kept while they are the fake model's next token, plus one of its own."""
        rows = [self.rows[d.slot] for d in plan.verify]
        self.forwards.append(
            Forward([(r.request_id, [r.last, *d.tokens]) for r, d in zip(rows, plan.verify)])
        )
        slots, tokens, counts, drafted = [], [], [], []
        for row, d in zip(rows, plan.verify):
            assert row.last is not None
            if self.block_size is not None:
                end = row.position + 1 + len(d.tokens)
                assert end <= row.table * self.block_size, f"{row.request_id}: no slots"
            emitted, last = [], row.last
            for j, token in enumerate(d.tokens):
                if token != self._masked(d.slot, (last + 1) % VOCAB, plan.masks, j):
                    break
                emitted.append(token)
                last = token
            emitted.append(self._masked(d.slot, (last + 1) % VOCAB, plan.masks, len(emitted)))
            row.position += len(emitted)  # the last token and the accepted drafts
            row.last = emitted[-1]
            slots.append(d.slot)
            tokens.extend(emitted)
            counts.append(len(emitted))
            drafted.append(len(d.tokens))
        return StepResult(
            -1,
            np.asarray(slots, np.int32),
            np.asarray(tokens, np.int32),
            counts=np.asarray(counts, np.int32),
            drafted=np.asarray(drafted, np.int32),
        )

    @staticmethod
    def dispatch(pending: _Pending) -> _Pending:
        return pending

    def load_adapter(self, name: str, path: str, slot: int) -> AdapterDescription:
        """Any path loads, but one named "refused"."""
        if path == "refused":
            raise ModelLoadError(f"adapter {name!r} ({path}): refused")
        assert slot not in self.adapters
        self.adapters[slot] = name
        return AdapterDescription(name, path, rank=8)

    def take_prefill(self, pending: _Pending) -> StepResult:
        parts, pending.prefill = pending.prefill, []
        result = StepResult.merge(pending.plan.step, parts)
        result.prefill_rows = len(result.slots)
        return result

    def collect(self, pending: _Pending) -> StepResult:
        assert not pending.waiting, "a constrained step was read before its masks came"
        self.calls.append(("collect", pending.plan.step))
        # The forwards' time has passed once their tokens are read (as on a device).
        self.clock.now += pending.seconds
        pending.seconds = 0.0
        parts = list(pending.prefill)
        prefill_rows = sum(len(p.slots) for p in parts)
        pending.prefill = []
        if pending.decode is not None:
            parts.append(pending.decode)
        result = StepResult.merge(pending.plan.step, parts)
        result.prefill_rows = prefill_rows
        result.decoded = pending.decode is not None
        return result

    def read_beside(self, pending: _Pending) -> StepResult | None:
        """As the model runner's: a plain decode step is read, anything else is left to
        `collect` on the loop thread."""
        if pending.prefill or pending.decode is None or pending.waiting:
            return None
        self.beside_threads.append(threading.current_thread().name)
        return self.collect(pending)


def _result(sampled: list[tuple[int, int]]) -> StepResult:
    return StepResult(
        -1,
        np.asarray([s for s, _ in sampled], np.int32),
        np.asarray([t for _, t in sampled], np.int32),
    )


def _or_zeros(values: np.ndarray | None, n: int) -> np.ndarray:
    return values if values is not None else np.zeros(n, np.int32)


@dataclass
class Delivered:
    """One request's share of one tick's outputs."""

    rid: int
    token_ids: list[int] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    final: Final | None = None

    @property
    def finished(self) -> bool:
        return self.final is not None


class ListSink:
    """A request's own sink: each tick's outputs appended as one call (and, given a clock, the
    time of each call that carried tokens)."""

    def __init__(
        self,
        calls: list[list[Delivered]],
        token_times: list[float] | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        self.batch_key = id(self)
        self._calls = calls
        self._token_times = token_times
        self._clock = clock

    def deliver(self, outputs: Outputs) -> None:
        rids = dict.fromkeys([*outputs.events, *outputs.rids, *outputs.finals])
        call = {rid: Delivered(rid) for rid in rids}
        for rid, events in outputs.events.items():
            call[rid].events.extend(events)
        counts = outputs.counts or [1] * len(outputs.rids)
        offset = 0
        for rid, n in zip(outputs.rids, counts):
            call[rid].token_ids.extend(outputs.tokens[offset : offset + n])
            offset += n
        for rid, final in outputs.finals.items():
            call[rid].final = final
        self._calls.append(list(call.values()))
        if outputs.tokens and self._token_times is not None and self._clock is not None:
            self._token_times.append(self._clock.now)


class Harness:
    """The real scheduler and core loop on a fake runner, plus what each request received
    through its sink. `kv`: the scheduler's KV manager (UnpagedKV: storage without blocks);
    `batched`: rows share a forward (else each prefill row is a forward of its own)."""

    def __init__(
        self,
        cost: ForwardCost | None = flat_cost,
        kv: KVManager | None = None,
        batched: bool = True,
        constraints: Constraints | None = None,
        steer: Steer | None = None,
        adapters: Seq[str] = (),
        beside: bool = False,
        **config,
    ) -> None:
        """`adapters`: names of LoRA adapters served from the start (slots 1, 2, ...);
        `beside`: the loop reads plain decode steps on its second thread while it dispatches
        the next (update_beside_dispatch, with overlapped steps)."""
        self.engine = FakeRunner(config=EngineConfig(batched=batched), cost=cost, steer=steer)
        table = AdapterTable()
        for name in adapters:
            slot = table.free_slot()
            table.add(name, slot)
            self.engine.adapters[slot] = name
        self.kv = kv or UnpagedKV()
        if isinstance(self.kv, KVCacheManager):
            self.engine.block_size = self.kv.block_size
        self.sched = Scheduler(
            SchedulerConfig(**config),
            frozenset({EOS}),
            kv=self.kv,
            batched=batched,
            clock=self.engine.clock,
            constraints=constraints,
            adapters=table,
        )
        self.rejected: dict[str, str] = {}  # request id -> why its adapter was refused
        self.adapters_changed = 0
        self.loop = CoreLoop(
            self.sched,
            self.engine,
            overlap_steps=beside,
            update_beside_dispatch=beside,
            on_rejected=lambda seq, why: self.rejected.__setitem__(seq.request_id, why),
            on_adapters_changed=self._adapters_changed,
        )
        self.received: dict[str, list[list[Delivered]]] = {}
        self.seqs: dict[str, Request] = {}
        # Per request, the fake clock's time of each delivery that carried tokens.
        self.token_times: dict[str, list[float]] = {}

    def _adapters_changed(self) -> None:
        self.adapters_changed += 1

    @property
    def forwards(self) -> list[Forward]:
        return self.engine.forwards

    def prefill_chunks(self, request_id: str) -> list[int]:
        """Token counts of the prefill rows the runner ran for request_id, in order."""
        return [
            len(tokens)
            for f in self.engine.forwards
            for seq_id, tokens in f.rows
            if seq_id == request_id and tokens is not None and not f.is_decode
        ]

    def submit(
        self,
        request_id: str,
        prompt: Seq[int] = (1, 2, 3),
        *,
        max_tokens: int = 4,
        grammar: Compiled | None = None,
        **kw,
    ) -> Request:
        """`grammar`: the request's compiled response format (as the core server sets it)."""
        request = GenerationRequest(request_id, tuple(prompt), max_tokens=max_tokens, **kw)
        calls = self.received.setdefault(request_id, [])
        times = self.token_times.setdefault(request_id, [])
        rid = len(self.seqs) + 1
        seq = Request(request, ListSink(calls, times, self.engine.clock), rid=rid)
        seq.grammar = grammar
        self.loop.submit(seq)
        self.seqs[request_id] = seq
        return seq

    def cancel(self, request_id: str) -> None:
        """What the front end does when the RPC of request_id's latest sequence ends early."""
        self.loop.cancel(self.seqs[request_id])

    def tick(self) -> None:
        """One turn of the core loop: what arrived, one step, its outputs delivered."""
        assert self.loop._drain(block=False)
        self.loop.turn()
        self.loop._deliver()

    def run(self, max_ticks: int = 500) -> int:
        """Tick until every submitted request has finished; returns the ticks it took."""
        for n in range(1, max_ticks + 1):
            self.tick()
            if not self.sched.busy and self.loop._inflight is None:
                return n
        raise AssertionError("requests did not finish")

    def outputs(self, request_id: str) -> list[Delivered]:
        return [out for call in self.received[request_id] for out in call]

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs(request_id) for t in out.token_ids]

    def final(self, request_id: str) -> Final:
        finals = [out for out in self.outputs(request_id) if out.finished]
        assert len(finals) == 1, "exactly one final output"
        assert self.outputs(request_id)[-1] is finals[0], "the final output comes last"
        assert finals[0].final is not None
        return finals[0].final

    @property
    def running(self) -> list[Request]:
        return self.sched.running
