"""Tiny random-weight models and engines over them: the shared helpers of the engine tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from service.core.engine.batch_view import StepLayout
from service.core.engine.config import EngineConfig
from service.core.engine.kv_dense import DenseKVStorage
from service.core.engine.kv_paged import PagedKVStorage
from service.core.engine.runner import ModelRunner, Pending, Row
from service.core.engine.sampler import SamplingParams
from service.core.engine.storage import KVStorage
from service.core.kv.block_pool import KVCacheManager, KVManager, SequenceBlocks, UnpagedKV
from service.core.models.layout import CacheLayout, probe_layout
from service.core.scheduler.plan import (
    Chunk,
    Draft,
    RowJoin,
    RowLeave,
    RowMasks,
    StepPlan,
    StepResult,
)

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 256


def tiny_llama(
    hidden_size: int = 64, heads: int = 4, kv_heads: int = KV_HEADS, seed: int = 7
) -> llama.Model:
    """A random llama of LAYERS layers; head_dim = hidden_size / heads (16 by default)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden_size,
        num_hidden_layers=LAYERS,
        intermediate_size=2 * hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def layout_of(model) -> CacheLayout:
    return probe_layout(model)


class OutOfBlocks(RuntimeError):
    """The test's pool has no slots for a row (the scheduler would preempt or wait)."""


@dataclass(eq=False)
class Seq:
    """A sequence a test drives: its runner slot and its KV block table."""

    seq_id: str
    slot: int
    blocks: SequenceBlocks
    driver: Driven

    @property
    def num_cached(self) -> int:
        return int(self.driver.engine.positions[self.slot])

    @property
    def row(self) -> Row:
        row = self.driver.engine.rows[self.slot]
        assert row is not None
        return row

    @property
    def sampler(self) -> Any:
        return self.row.sampler

    @property
    def state(self) -> Any:
        return self.row.state


@dataclass
class StepRow:
    """One row of a forward: tokens to feed (None: the last sampled token)."""

    seq: Seq
    tokens: Sequence[int] | None = None
    sample: bool = True


@dataclass
class DraftRow:
    seq: Seq
    last_token: int  # what the row sampled last (the runner feeds it from its own table)
    draft: list[int] = field(default_factory=list)


@dataclass
class RowResult:
    seq: Seq
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None


@dataclass
class Verified:
    seq: Seq
    results: list[RowResult]
    drafted: int
    accepted: int


class Driven:
    """A model runner driven straight by a test through step plans, with the scheduler's KV part
    done here as service.core.scheduler does it: a KVCacheManager (paged storage; UnpagedKV
    otherwise) reserves each row's slots before its forward, and the plan carries the rows'
    block tables and the manager's BlockUpdate."""

    def __init__(self, engine: ModelRunner, prefix_caching: bool = True) -> None:
        self.engine = engine
        self.kv: KVManager = UnpagedKV()
        self.manager: KVCacheManager | None = None
        if engine.config.paged:
            storage = engine.storage
            assert isinstance(storage, PagedKVStorage)
            self.manager = KVCacheManager(
                storage.num_blocks,
                storage.block_size,
                prefix_caching,
                capacity=storage.capacity_blocks,
            )
            self.kv = self.manager
        self._free = list(range(len(engine.rows) - 1, -1, -1))
        self._step = 0
        self._pending: StepPlan | None = None  # membership changes not yet applied
        self._live: dict[int, Seq] = {}

    @property
    def storage(self) -> KVStorage:
        return self.engine.storage

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def states(self) -> Any:
        return self.engine.states

    def blocks(self, seq: Seq) -> SequenceBlocks:
        return seq.blocks

    def _plan(self) -> StepPlan:
        if self._pending is None:
            self._step += 1
            self._pending = StepPlan(self._step)
        return self._pending

    def add_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        adopt: bool = False,
        want_logprobs: bool = False,
        top_logprobs: int = 0,
        constrained: bool = False,
        adapter: int = 0,
        root: int | None = None,
    ) -> Seq:
        """`adopt`: admit it as the scheduler does (cached prefix adopted, prompt reserved);
        `constrained`: it samples under token masks (give them with each step); `adapter`: its
        LoRA adapter's slot; `root`: its prefix-cache namespace."""
        blocks = self.kv.new_sequence(root=root)
        cached = 0
        if adopt:
            admitted = self.kv.admit(blocks, prompt_token_ids, True, 0)
            if admitted is None:
                raise OutOfBlocks(seq_id)
            cached = admitted
        slot = self._free.pop()
        plan = self._plan()
        plan.joins.append(
            RowJoin(
                slot,
                seq_id,
                params,
                list(prompt_token_ids),
                cached,
                want_logprobs,
                top_logprobs,
                constrained=constrained,
                adapter=adapter,
            )
        )
        seq = Seq(seq_id, slot, blocks, self)
        self._live[slot] = seq
        self._flush()
        return seq

    def release(self, seq: Seq) -> None:
        self.kv.free_sequence(seq.blocks)
        self._plan().leaves.append(RowLeave(seq.slot, True))
        self._free.append(seq.slot)
        self._live.pop(seq.slot, None)
        self._flush()

    def unload_adapter(self, slot: int) -> None:
        """A plan that clears an adapter slot (its adapter was unloaded)."""
        self._plan().unload.append(slot)
        self._flush()

    def _flush(self) -> None:
        """Apply pending membership changes now (no forward)."""
        if self._pending is not None:
            plan, self._pending = self._pending, None
            self.engine.collect(self.engine.submit(plan))

    def commit(self, seq: Seq, token_ids: Sequence[int]) -> int:
        """Register the sequence's computed full blocks in the prefix cache."""
        return self.kv.register_full_blocks(seq.blocks, token_ids[: seq.num_cached])

    def _reserve(self, plan: StepPlan, seq: Seq, num_new: int) -> None:
        if not self.kv.ensure_slots(seq.blocks, seq.num_cached + self._queued(plan, seq) + num_new):
            raise OutOfBlocks(seq.seq_id)
        plan.tables.append((seq.slot, list(seq.blocks.block_ids)))

    @staticmethod
    def _queued(plan: StepPlan, seq: Seq) -> int:
        """Positions a plan's earlier forwards feed before this one's."""
        return sum(len(c.tokens) for f in plan.prefill for c in f if c.slot == seq.slot)

    def _seal(self, plan: StepPlan) -> StepPlan:
        self._pending = None
        update = self.kv.take_update()
        plan.capacity, plan.copies = update.capacity, list(update.copies)
        return plan

    def submit(
        self, rows: list[StepRow], dispatch: bool = True, masks: RowMasks | None = None
    ) -> Pending:
        """One forward of `rows`: a prefill forward when every row feeds tokens, else a decode
        forward (rows feeding their last sampled token). `masks`: the plan's (prefill rows
        that sample); a decode step's constrained rows take theirs through `sample`."""
        plan = self._plan()
        plan.masks = masks
        if all(r.tokens is not None for r in rows):
            for r in rows:
                self._reserve(plan, r.seq, len(r.tokens or ()))
            plan.prefill.append([Chunk(r.seq.slot, list(r.tokens or ()), r.sample) for r in rows])
        else:
            assert all(r.tokens is None for r in rows), "a forward is prefill or decode"
            for r in rows:
                self._reserve(plan, r.seq, 1)
            plan.decode = [r.seq.slot for r in rows]
        return self.engine.submit(self._seal(plan), dispatch)

    def dispatch(self, pending: Pending) -> Pending:
        return self.engine.dispatch(pending)

    def sample(self, pending: Pending, masks: RowMasks) -> Pending:
        return self.engine.sample(pending, masks)

    def finish_rows(self, pending: Pending) -> list[RowResult]:
        return self.results(self.engine.collect(pending), pending.plan)

    def results(self, result: StepResult, plan: StepPlan) -> list[RowResult]:
        """The rows' results in the plan's order (a decode forward may run them in the
        storage's order)."""
        out = []
        for i, slot in enumerate(result.slots.tolist()):
            res = RowResult(self._live[slot], token_id=int(result.tokens[i]))
            if result.logprobs is not None:
                res.logprob = float(result.logprobs[i])
                if result.top_ids is not None and result.top_logprobs is not None:
                    res.top_logprobs = list(
                        zip(result.top_ids[i].tolist(), result.top_logprobs[i].tolist())
                    )
            out.append(res)
        out += [RowResult(self._live[s], error=e) for s, e in result.errors.items()]
        if plan.decode:
            rank = {slot: i for i, slot in enumerate(plan.decode)}
            out.sort(key=lambda r: rank.get(r.seq.slot, len(rank)))
        return out

    def prefill(self, rows: list[StepRow]) -> list[RowResult]:
        return self.finish_rows(self.submit(rows))

    def step(self, rows: list[StepRow]) -> list[RowResult]:
        return self.finish_rows(self.submit(rows))

    def verify(self, rows: list[DraftRow], masks: RowMasks | None = None) -> list[Verified]:
        """A verification forward, then the rejected drafts' slots given back."""
        plan = self._plan()
        plan.masks = masks
        for r in rows:
            self._reserve(plan, r.seq, 1 + len(r.draft))
            plan.verify.append(Draft(r.seq.slot, list(r.draft)))
        result = self.engine.collect(self.engine.submit(self._seal(plan)))
        assert result.counts is not None and result.drafted is not None
        out, offset = [], 0
        for i, r in enumerate(rows):
            n = int(result.counts[i])
            emitted = [
                RowResult(
                    r.seq,
                    token_id=int(result.tokens[j]),
                    logprob=None if result.logprobs is None else float(result.logprobs[j]),
                )
                for j in range(offset, offset + n)
            ]
            offset += n
            out.append(Verified(r.seq, emitted, int(result.drafted[i]), n - 1))
            self.kv.truncate(r.seq.blocks, r.seq.num_cached)
        return out


def step_layout(
    handles: Sequence[Any],
    starts: Sequence[int],
    lengths: Sequence[int],
    tables: Sequence[Sequence[int]] = (),
) -> StepLayout:
    """A StepLayout from per-row lists (block tables padded into one array)."""
    width = max((len(t) for t in tables), default=0)
    table = np.zeros((len(tables), max(1, width)), np.int32)
    for i, ids in enumerate(tables):
        table[i, : len(ids)] = ids
    return StepLayout(
        list(handles),
        np.asarray(starts, np.int32),
        np.asarray(lengths, np.int32),
        table,
        np.asarray([len(t) for t in tables], np.int32),
        np.arange(len(handles), dtype=np.int32),
    )


def make_engine(
    model, storage, config: EngineConfig | None = None, prefix_caching: bool = True, **kw
) -> Driven:
    """A runner over `storage` (the config's storage set to match), driven with a manager."""
    config = replace(config or EngineConfig(), storage=storage.name)
    blocks = storage.num_blocks if isinstance(storage, PagedKVStorage) else 0
    runner = ModelRunner(
        model,
        storage,
        layout_of(model),
        config,
        max_rows=kw.pop("max_rows", 8),
        max_blocks_per_row=blocks,
        split_head=True,
        **kw,
    )
    return Driven(runner, prefix_caching)


def paged(num_blocks: int = 64, block_size: int = 8, **kw) -> PagedKVStorage:
    """kw: initial_blocks, and decode_attention / in_place as the engine's config says."""
    return PagedKVStorage(LAYERS, KV_HEADS, HEAD_DIM, mx.float32, num_blocks, block_size, **kw)


def dense() -> DenseKVStorage:
    return DenseKVStorage(LAYERS, KV_HEADS, HEAD_DIM, mx.float32)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + i * 17 + (i * i) % 7) % VOCAB for i in range(length)]


PROMPTS = [prompt(1, 5), prompt(2, 13), prompt(3, 30)]


def generate(engine: Driven, prompts: list[list[int]], steps: int = 20, tag: str = "s"):
    seqs = [engine.add_sequence(f"{tag}{i}", SamplingParams(), p) for i, p in enumerate(prompts)]
    results = engine.prefill([StepRow(s, p) for s, p in zip(seqs, prompts)])
    out = [[r.token_id] for r in results]
    for _ in range(steps):
        for o, r in zip(out, engine.step([StepRow(s) for s in seqs])):
            o.append(r.token_id)
    return seqs, out


def run_split(engine: Driven, tokens: list[int], split: int, steps: int, adopt: bool = False):
    """Prefill tokens[:split] (or adopt them) then tokens[split:], then decode greedily."""
    seq = engine.add_sequence("split", SamplingParams(), tokens, adopt=adopt)
    if not adopt:
        engine.prefill([StepRow(seq, tokens[:split], sample=False)])
    assert seq.num_cached == split
    out = [engine.prefill([StepRow(seq, tokens[split:])])[0].token_id]
    for _ in range(steps):
        out.append(engine.step([StepRow(seq)])[0].token_id)
    return seq, out
