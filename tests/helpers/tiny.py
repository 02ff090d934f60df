"""Tiny random-weight models and engines over them: the shared helpers of the engine tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama

from service.core.engine.config import EngineConfig
from service.core.engine.engine import (
    DraftRow,
    Engine,
    EngineSequence,
    PendingStep,
    RowResult,
    StepRow,
    Verified,
)
from service.core.engine.kv_dense import DenseKVStorage
from service.core.engine.kv_paged import PagedKVStorage
from service.core.engine.sampler import SamplingParams
from service.core.engine.storage import KVStorage
from service.core.kv.block_pool import KVCacheManager, KVManager, SequenceBlocks, UnpagedKV
from service.core.models.layout import CacheLayout, probe_layout

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


class Driven:
    """An engine driven straight by a test, with the scheduler's KV part done here as
    service.core.scheduler does it: a KVCacheManager (paged storage; UnpagedKV otherwise) reserves
    each row's slots before its forward, and the engine gets the rows' block tables and the
    manager's BlockUpdate. The Engine's own calls, with the same signatures."""

    def __init__(self, engine: Engine, prefix_caching: bool = True) -> None:
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
        self._blocks: dict[int, SequenceBlocks] = {}  # id(EngineSequence) -> its table

    @property
    def storage(self) -> KVStorage:
        return self.engine.storage

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def states(self) -> Any:
        return self.engine.states

    def blocks(self, seq: EngineSequence) -> SequenceBlocks:
        return self._blocks[id(seq)]

    def add_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        adopt: bool = False,
        **kw: Any,
    ) -> EngineSequence:
        """`adopt`: admit it as the scheduler does (cached prefix adopted, prompt reserved)."""
        blocks = self.kv.new_sequence()
        cached = 0
        if adopt:
            admitted = self.kv.admit(blocks, prompt_token_ids, True, 0)
            if admitted is None:
                raise OutOfBlocks(seq_id)
            cached = admitted
        seq = self.engine.add_sequence(seq_id, params, prompt_token_ids, num_cached=cached, **kw)
        self._blocks[id(seq)] = blocks
        return seq

    def release(self, seq: EngineSequence) -> None:
        self.kv.free_sequence(self._blocks.pop(id(seq)))
        self.engine.release(seq)

    def commit(self, seq: EngineSequence, token_ids: Sequence[int]) -> int:
        """Register the sequence's computed full blocks in the prefix cache."""
        return self.kv.register_full_blocks(self.blocks(seq), token_ids[: seq.num_cached])

    def _reserve(self, seq: EngineSequence, num_new: int) -> Sequence[int]:
        blocks = self.blocks(seq)
        if not self.kv.ensure_slots(blocks, seq.num_cached + num_new):
            raise OutOfBlocks(seq.seq_id)
        return blocks.block_ids

    def submit(self, rows: list[StepRow], dispatch: bool = True) -> PendingStep:
        for r in rows:
            r.block_ids = self._reserve(r.seq, 1 if r.tokens is None else len(r.tokens))
        return self.engine.submit(rows, dispatch, self.kv.take_update())

    def dispatch(self, pending: PendingStep) -> PendingStep:
        return self.engine.dispatch(pending)

    def finish_rows(self, pending: PendingStep) -> list[RowResult]:
        return self.engine.finish_rows(pending)

    def prefill(self, rows: list[StepRow]) -> list[RowResult]:
        return self.finish_rows(self.submit(rows))

    def step(self, rows: list[StepRow]) -> list[RowResult]:
        for r in rows:
            r.block_ids = self._reserve(r.seq, 1 if r.tokens is None else len(r.tokens))
        return self.engine.step(rows, self.kv.take_update())

    def verify(self, rows: list[DraftRow]) -> list[Verified]:
        """A verification forward, then the rejected drafts' slots given back."""
        for r in rows:
            r.block_ids = self._reserve(r.seq, 1 + len(r.draft))
        verified = self.engine.verify(rows, self.kv.take_update())
        for v in verified:
            self.kv.truncate(self.blocks(v.seq), v.seq.num_cached)
        return verified


def make_engine(
    model, storage, config: EngineConfig | None = None, prefix_caching: bool = True, **kw
) -> Driven:
    """An engine over `storage` (the config's storage set to match), driven with a manager."""
    config = replace(config or EngineConfig(), storage=storage.name)
    engine = Engine(model, storage, layout_of(model), config, split_head=True, **kw)
    return Driven(engine, prefix_caching)


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
