"""A fake engine for the scheduler tests (the Engine's interface, deterministic, on a fake
clock) and a harness that runs a real Scheduler on it one tick at a time, recording what each
request received."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from service.core.engine.config import EngineConfig
from service.core.engine.engine import (
    DraftRow,
    EngineSequence,
    PendingStep,
    RowResult,
    StepRow,
    Verified,
)
from service.core.engine.sampler import SamplingParams
from service.core.kv.block_pool import BlockUpdate, KVCacheManager, KVManager, UnpagedKV
from service.core.scheduler.request import Request
from service.core.scheduler.scheduler import Scheduler, SchedulerConfig
from service.protocol import Final, GenerationRequest, StepOutput

VOCAB = 1000
EOS = 999


@dataclass
class Forward:
    """One recorded engine.submit: per row, the sequence id and the tokens fed (None: decode)."""

    rows: list[tuple[str, list[int] | None]]

    @property
    def is_decode(self) -> bool:
        return all(tokens is None for _, tokens in self.rows)

    @property
    def ids(self) -> list[str]:
        return [seq_id for seq_id, _ in self.rows]


@dataclass
class FakeClock:
    """Seconds that pass only when the fake engine runs a forward."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


# Seconds of one forward from its rows: (tokens fed, or None for a decode row; tokens cached).
ForwardCost = Callable[[list[tuple[int | None, int]]], float]


def flat_cost(rows: list[tuple[int | None, int]]) -> float:
    """The default: 10 ms a forward plus 10 us a prompt token, whatever the context."""
    return 0.010 + 1e-5 * sum(n or 0 for n, _ in rows)


@dataclass
class FakeEngine:
    """The Engine's interface, deterministic: the next token is (last input + 1) % VOCAB.
    Each forward advances `clock` by `cost` of its rows (nothing by default). `block_tables`:
    the block table each row of each forward came with (checked against its positions when
    `block_size` is set: the paged pool's contract)."""

    config: EngineConfig = field(default_factory=EngineConfig)
    clock: FakeClock = field(default_factory=FakeClock)
    cost: ForwardCost | None = None
    forwards: list[Forward] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    # Live engine sequences by object (two may share a request id: a reused one).
    live_seqs: dict[int, str] = field(default_factory=dict)
    _seconds: dict[int, float] = field(default_factory=dict)  # of each unread forward
    block_size: int | None = None
    updates: list[BlockUpdate] = field(default_factory=list)

    @property
    def live(self) -> set[str]:
        return set(self.live_seqs.values())

    @property
    def batched(self) -> bool:
        return self.config.batched

    def add_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        prompt_token_ids: Seq[int],
        num_cached: int = 0,
        **kwargs,
    ) -> EngineSequence:
        self.added.append(seq_id)
        seq = EngineSequence(seq_id, kv=object(), sampler=kwargs.get("sampler"))
        seq.num_cached = num_cached
        self.live_seqs[id(seq)] = seq_id
        return seq

    def release(self, seq: EngineSequence, final: bool = True) -> None:
        self.released.append(seq.seq_id)
        self.live_seqs.pop(id(seq), None)
        seq.next_input = None
        seq.num_cached = 0

    @staticmethod
    def dispatch(pending: PendingStep) -> PendingStep:
        return pending

    def submit(
        self, rows: list[StepRow], dispatch: bool = True, update: BlockUpdate | None = None
    ) -> PendingStep:
        if not self.batched:
            assert len(rows) == 1
        if update is not None:
            self.updates.append(update)
        self.forwards.append(
            Forward([(r.seq.seq_id, None if r.tokens is None else list(r.tokens)) for r in rows])
        )
        seconds = 0.0
        if self.cost is not None:
            shapes = [(None if r.tokens is None else len(r.tokens), r.seq.num_cached) for r in rows]
            seconds = self.cost(shapes)
        sampled, tokens = [], []
        for i, r in enumerate(rows):
            assert id(r.seq) in self.live_seqs, f"{r.seq.seq_id} runs after its release"
            inputs = list(r.tokens) if r.tokens is not None else [r.seq.next_input]
            assert inputs and None not in inputs
            if self.block_size is not None:
                end = r.seq.num_cached + len(inputs)
                assert end <= len(r.block_ids) * self.block_size, f"{r.seq.seq_id}: no slots"
            r.seq.num_cached += len(inputs)
            if r.sample:
                token = (inputs[-1] + 1) % VOCAB
                r.seq.next_input = token
                sampled.append(i)
                tokens.append(token)
        pending = PendingStep(rows, sampled, tokens if sampled else None, None, None, None)
        self._seconds[id(pending)] = seconds
        return pending

    def finish_rows(self, pending: PendingStep) -> list[RowResult]:
        # The forward's time has passed once its tokens are read (as on a device).
        self.clock.now += self._seconds.pop(id(pending), 0.0)
        if pending.tokens is None:
            return []
        return [
            RowResult(pending.rows[i].seq, token_id=t)
            for i, t in zip(pending.sampled_rows, pending.tokens)
        ]

    def verify(self, rows: list[DraftRow], update: BlockUpdate | None = None) -> list[Verified]:
        """Drafts are kept while they are the fake model's next token, plus one of its own."""
        if update is not None:
            self.updates.append(update)
        self.forwards.append(Forward([(r.seq.seq_id, [r.last_token, *r.draft]) for r in rows]))
        out = []
        for r in rows:
            if self.block_size is not None:
                end = r.seq.num_cached + 1 + len(r.draft)
                assert end <= len(r.block_ids) * self.block_size, f"{r.seq.seq_id}: no slots"
            emitted, last = [], r.last_token
            for token in r.draft:
                if token != (last + 1) % VOCAB:
                    break
                emitted.append(token)
                last = token
            emitted.append((last + 1) % VOCAB)
            r.seq.num_cached += len(emitted)  # the last token and the accepted drafts
            r.seq.next_input = emitted[-1]
            results = [RowResult(r.seq, token_id=t) for t in emitted]
            out.append(Verified(r.seq, results, len(r.draft), len(emitted) - 1))
        return out

    def prefill(self, rows: list[StepRow], update: BlockUpdate | None = None) -> list[RowResult]:
        return self.finish_rows(self.submit(rows, update=update))

    def step(self, rows: list[StepRow], update: BlockUpdate | None = None) -> list[RowResult]:
        return self.finish_rows(self.submit(rows, update=update))


class Harness:
    """A scheduler on a fake engine, plus what each request received through its sink.
    `kv`: the scheduler's KV manager (UnpagedKV: storage without blocks)."""

    def __init__(
        self, cost: ForwardCost | None = flat_cost, kv: KVManager | None = None, **config
    ) -> None:
        self.engine = FakeEngine(cost=cost)
        self.kv = kv or UnpagedKV()
        if isinstance(self.kv, KVCacheManager):
            self.engine.block_size = self.kv.block_size
        self.sched = Scheduler(
            self.engine,
            SchedulerConfig(**config),
            eos_token_ids=frozenset({EOS}),
            kv=self.kv,
            clock=self.engine.clock,
        )
        self.received: dict[str, list[list[StepOutput]]] = {}
        self.seqs: dict[str, Request] = {}
        # Per request, the engine clock's time of each delivery that carried tokens.
        self.token_times: dict[str, list[float]] = {}

    def prefill_chunks(self, request_id: str) -> list[int]:
        """Token counts of the prefill rows the engine ran for request_id, in order."""
        return [
            len(tokens)
            for f in self.engine.forwards
            for seq_id, tokens in f.rows
            if seq_id == request_id and tokens is not None
        ]

    def submit(
        self, request_id: str, prompt: Seq[int] = (1, 2, 3), *, max_tokens: int = 4, **kw
    ) -> Request:
        request = GenerationRequest(request_id, tuple(prompt), max_tokens=max_tokens, **kw)
        calls = self.received.setdefault(request_id, [])
        times = self.token_times.setdefault(request_id, [])
        rid = len(self.seqs) + 1
        seq = Request(request, ListSink(calls, times, self.engine.clock), rid=rid)
        self.sched.submit(seq)
        self.seqs[request_id] = seq
        return seq

    def cancel(self, request_id: str) -> None:
        """What the servicer does when the RPC of request_id's latest sequence ends early."""
        self.sched.cancel(self.seqs[request_id])

    def tick(self) -> None:
        assert self.sched._drain(block=False)
        self.sched.tick()
        self.sched._flush_outbox()

    def run(self, max_ticks: int = 500) -> int:
        """Tick until every submitted request has finished; returns the ticks it took."""
        for n in range(1, max_ticks + 1):
            self.tick()
            if all(s.is_finished for s in self.seqs.values()) and self.sched._inflight is None:
                return n
        raise AssertionError("requests did not finish")

    def outputs(self, request_id: str) -> list[StepOutput]:
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


class ListSink:
    """A request's own sink: each tick's outputs appended as one call (and, given a clock, the
    time of each call that carried tokens)."""

    def __init__(
        self,
        calls: list[list[StepOutput]],
        token_times: list[float] | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        self.batch_key = id(self)
        self._calls = calls
        self._token_times = token_times
        self._clock = clock

    def deliver(self, outputs: list[StepOutput]) -> None:
        self._calls.append(outputs)
        tokens = any(out.token_ids for out in outputs)
        if tokens and self._token_times is not None and self._clock is not None:
            self._token_times.append(self._clock.now)
