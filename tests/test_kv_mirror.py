"""The decode mirror (service.core.engine.kv_mirror) on a tiny random-weight llama: the same logits
and tokens as gathering from the pool, through rows joining, leaving and outgrowing the mirror;
only the rows that changed are copied in; the byte limit falls back to gathering."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.decode_primitives import primitives
from service.core.engine import kv_mirror
from service.core.engine.config import EngineConfig
from service.core.engine.sampler import SamplingParams
from service.core.kv.block_pool import KVCacheManager
from tests.helpers.tiny import (
    LAYERS,
    PROMPTS,
    StepRow,
    generate,
    layout_of,
    make_engine,
    paged,
    prompt,
    step_layout,
    tiny_llama,
)

MIRROR = EngineConfig(decode_attention="mirror")
MIRROR_ATTENDS = EngineConfig(decode_attention="mirror", fast_mirror_attention=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def mirrored(model, max_bytes: int = 1 << 30, attends: bool = False, **kw):
    """An engine whose decode steps attend over the mirror, and its storage. `attends`: with
    the mirror's own attention (kv_mirror.attend), as float32 models on the CPU run."""
    storage = paged(decode_attention="mirror", mirror_attends=attends, **kw)
    engine = make_engine(model, storage, MIRROR_ATTENDS if attends else MIRROR)
    storage.mirror.max_bytes = max_bytes
    return engine, storage


def test_mirror_gives_the_gathered_tokens(model):
    """Rows of different lengths (left padding masked), decoded together for 20 steps."""
    outs = {}
    for kind in ("gather", "mirror"):
        if kind == "mirror":
            engine, storage = mirrored(model)
        else:
            storage = paged()
            engine = make_engine(model, storage)
        seqs, outs[kind] = generate(engine, PROMPTS)
        if kind == "mirror":
            # Allocated and filled once, then appended in place.
            assert storage.mirror.allocations == 1
            assert storage.mirror.copied_rows == len(PROMPTS)
            assert storage.reserved_bytes > (storage._capacity_blocks + 1) * storage.bytes_per_block
        for s in seqs:
            engine.release(s)
        assert engine.manager is not None and engine.manager.stats().num_active_blocks == 0
    assert outs["mirror"] == outs["gather"]


def test_mirror_logits_match_gathered_logits_step_by_step(model):
    stores = {"gather": paged(), "mirror": mirrored(model)[1]}
    managers = {k: KVCacheManager(64, 8) for k in stores}
    handles = {k: [s.new_sequence() for _ in PROMPTS] for k, s in stores.items()}
    tables = {k: [m.new_sequence() for _ in PROMPTS] for k, m in managers.items()}
    rows = [list(p) for p in PROMPTS]
    starts = [0, 0, 0]
    for step in range(6):
        logits = {}
        for kind, storage in stores.items():
            for t, s, r in zip(tables[kind], starts, rows):
                assert managers[kind].ensure_slots(t, s + len(r))
            storage.apply(managers[kind].take_update())
            width = max(len(r) for r in rows)
            tokens = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
            lengths = [len(r) for r in rows]
            block_tables = [t.block_ids for t in tables[kind]]
            layout = step_layout(list(handles[kind]), list(starts), lengths, block_tables)
            views = storage.views(layout, layout_of(model), None, False)
            logits[kind] = model(tokens, cache=views)
            mx.eval(logits[kind])
        last = mx.array([len(r) - 1 for r in rows])
        got = logits["mirror"][mx.arange(3), last]
        want = logits["gather"][mx.arange(3), last]
        assert mx.abs(got - want).max().item() < 1e-5, f"step {step}"
        nxt = mx.argmax(want, axis=-1).tolist()
        starts = [s + len(r) for s, r in zip(starts, rows)]
        rows = [[t] for t in nxt]
    assert stores["mirror"].mirror.allocations == 1  # step 0 was a prefill: no mirror there


def test_rows_joining_leaving_and_outgrowing_the_mirror(model, monkeypatch):
    """A staggered batch: a row leaves, another joins mid-way, and the mirror runs out of
    columns (small headroom) and is reallocated; no token changes."""
    monkeypatch.setattr(kv_mirror, "HEADROOM", 7)
    monkeypatch.setattr(kv_mirror, "COLUMN_ROUND", 1)
    prompts = [prompt(5, 9), prompt(6, 3), prompt(7, 21), prompt(8, 14)]

    def run(engine, storage):
        seqs = [engine.add_sequence(f"r{i}", SamplingParams(), p) for i, p in enumerate(prompts)]
        first = engine.prefill([StepRow(s, p) for s, p in zip(seqs[:3], prompts[:3])])
        out = {i: [first[i].token_id] if i < 3 else [] for i in range(4)}
        active = [0, 1, 2]
        for step in range(18):
            if step == 5:  # row 1 leaves
                engine.release(seqs[1])
                active = [0, 2]
            if step == 8:  # row 3 joins (its prefill step is a separate forward)
                out[3].append(engine.prefill([StepRow(seqs[3], prompts[3])])[0].token_id)
                active = [0, 2, 3]
            for i, r in zip(active, engine.step([StepRow(seqs[i]) for i in active])):
                out[i].append(r.token_id)
        for i in active:
            engine.release(seqs[i])
        return out, storage

    storage = paged()
    gathered, _ = run(make_engine(model, storage), storage)
    mirror_out, storage = run(*mirrored(model))
    assert mirror_out == gathered
    assert storage.mirror.allocations >= 2  # at the start, and on running out of columns
    assert storage.mirror.nbytes == 0  # released rows free the copy


def test_a_lone_row_gathers(model):
    engine, storage = mirrored(model)
    _, out = generate(engine, PROMPTS[:1], steps=4)
    assert out == generate(make_engine(model, paged()), PROMPTS[:1], steps=4)[1]
    assert storage.mirror.allocations == 0


def test_over_the_byte_limit_decode_steps_gather(model):
    engine, storage = mirrored(model, max_bytes=1)
    _, out = generate(engine, PROMPTS, steps=4)
    reference = generate(make_engine(model, paged()), PROMPTS, steps=4)[1]
    assert out == reference
    assert storage.mirror.allocations == 0 and storage.mirror.nbytes == 0


def test_a_batch_that_changes_every_step_copies_only_the_rows_that_changed(model):
    """Churn (a row leaves and another takes its place every step): the newcomer takes the row
    left free and is the only row copied in from the pool; the others stay where they are.
    No token changes."""
    prompts = [prompt(5, 9), prompt(6, 3), prompt(7, 12), prompt(8, 6)]
    plan = [[0, 1, 2], [1, 2, 3]] * 4 + [[0, 1, 2, 3]] * 3

    def run(engine, storage):
        seqs = [engine.add_sequence(f"r{i}", SamplingParams(), p) for i, p in enumerate(prompts)]
        first = engine.prefill([StepRow(s, p) for s, p in zip(seqs, prompts)])
        out = {i: [first[i].token_id] for i in range(4)}
        copied = []
        for active in plan:
            for i, r in zip(active, engine.step([StepRow(seqs[i]) for i in active])):
                out[i].append(r.token_id)
            copied.append(storage.mirror.copied_rows if storage.mirror is not None else 0)
        for s in seqs:
            engine.release(s)
        return out, copied

    storage = paged()
    gathered, _ = run(make_engine(model, storage), storage)
    engine, storage = mirrored(model)
    mirror_out, copied = run(engine, storage)
    assert mirror_out == gathered
    assert run(*mirrored(model, attends=True))[0] == gathered
    # All three at first, then the one newcomer per step; the fourth row joins once.
    assert copied == [3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11]
    assert storage.mirror.allocations == 1


@pytest.mark.parametrize("attends", [False, True], ids=["mlx-attention", "own-attention"])
def test_mirrored_steps_leave_no_pool_write_waiting(model, attends):
    """A mirrored step's attention reads only the mirror, yet its write into the pool is
    evaluated with it: no chain of writes waits in the graph for the next read of the pool."""
    engine, storage = mirrored(model, attends=attends)
    seqs, _ = generate(engine, PROMPTS, steps=6)
    assert storage.mirror.allocations == 1
    for pool in storage.pool_arrays():
        assert "Scatter" not in primitives(pool)
    for s in seqs:
        engine.release(s)


def test_a_one_token_prompt_beside_mirrored_rows_leaves_the_mirror_alone(model):
    """A one-token prompt (or a prompt's one-token chunk) prefilled while rows decode over the
    mirror is no decode step: the mirror keeps its rows (nothing freed, nothing copied back in)
    and every row's tokens are as when gathering."""

    def run(engine, storage):
        seqs, out = generate(engine, PROMPTS, steps=3)
        before = (storage.mirror.allocations, storage.mirror.copied_rows) if storage.mirror else 0
        lone = engine.add_sequence("lone", SamplingParams(), [7])
        out.append([engine.prefill([StepRow(lone, [7])])[0].token_id])
        for o, r in zip(out, engine.step([StepRow(s) for s in seqs])):
            o.append(r.token_id)
        after = (storage.mirror.allocations, storage.mirror.copied_rows) if storage.mirror else 0
        for s in [*seqs, lone]:
            engine.release(s)
        return out, before, after

    storage = paged()
    gathered, _, _ = run(make_engine(model, storage), storage)
    engine, storage = mirrored(model, attends=True)
    out, before, after = run(engine, storage)
    assert out == gathered
    assert after == before


def test_rows_keep_their_place_and_newcomers_fill_the_rows_left():
    mirror = kv_mirror.DecodeMirror(1 << 20)
    slots = np.array([3, 5, 9], np.int32)
    assert mirror.order_rows(slots) is slots  # nothing held yet: the order given
    mirror.order = np.array([5, 9, 3, -1], np.int32)
    assert mirror.order_rows(slots).tolist() == [5, 9, 3]
    # 9 left, 4 and 7 came: 5 and 3 stay in rows 0 and 2, the newcomers fill rows 1 and 3.
    assert mirror.order_rows(np.array([3, 4, 5, 7], np.int32)).tolist() == [5, 4, 3, 7]
    # The batch shrank: 3, held past the new batch size (row 2), moves to a row left free.
    assert mirror.order_rows(np.array([3, 4], np.int32)).tolist() == [3, 4]
    assert mirror.order_rows(np.array([8], np.int32)).tolist() == [8]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (9, 3)])
def test_the_mirrors_attention_is_mlx_attention(heads, kv_heads):
    """kv_mirror.attend against MLX's attention on strided views like the mirror's, with rows
    of different lengths (mask) and without."""
    b, dim, columns, span = 5, 32, 24, 17
    mx.random.seed(heads)
    keys = mx.random.normal((8, kv_heads, columns, dim))[:b, :, :span]
    values = mx.random.normal((8, kv_heads, columns, dim))[:b, :, :span]
    queries = mx.random.normal((b, heads, 1, dim)) * 3
    lengths = np.array([17, 3, 9, 1, 12])
    for mask in (mx.array(np.arange(span)[None, :] < lengths[:, None])[:, None, None, :], None):
        got = kv_mirror.attend(queries, keys, values, dim**-0.5, mask)
        want = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=dim**-0.5, mask=mask
        )
        assert got.shape == want.shape
        assert mx.abs(got - want).max().item() < 1e-5


def test_mirrored_steps_that_attend_themselves_give_the_gathered_tokens(model, monkeypatch):
    storage = paged()
    _, want = generate(make_engine(model, storage), PROMPTS)
    engine, storage = mirrored(model, attends=True)
    calls = []
    attend = storage.attend_mirrored
    monkeypatch.setattr(storage, "attend_mirrored", lambda *a: calls.append(1) or attend(*a))
    _, got = generate(engine, PROMPTS, steps=20)
    assert got == want
    assert len(calls) == 20 * LAYERS  # every decode step's every layer
    assert storage.mirror.allocations == 1


@given(
    held=st.lists(st.integers(-1, 40), max_size=48),
    slots=st.sets(st.integers(0, 40), min_size=2, max_size=40),
)
def test_the_row_order_is_a_permutation_that_keeps_held_rows(held, slots):
    """Whatever the mirror holds, the order is the step's slots once each, and a slot held at
    a row below the batch size stays in that row."""
    mirror = kv_mirror.DecodeMirror(1 << 20)
    rows = [-1] * len(held)  # a slot is held at one row at most
    for row, slot in enumerate(held):
        if slot not in rows:
            rows[row] = slot
    mirror.order = np.array(rows, np.int32)
    given = np.array(sorted(slots), np.int32)
    out = mirror.order_rows(given)
    assert sorted(out.tolist()) == given.tolist()
    for row, slot in enumerate(mirror.order[: len(given)].tolist()):
        if slot in slots:
            assert out[row] == slot


def test_a_drained_burst_gives_the_mirror_back_its_rows(model):
    """From 12 rows to 2: the arrays are reallocated for the rows left (16 rows -> 2), and
    the tokens stay the gathered ones."""
    prompts = [prompt(40 + i, 5 + i) for i in range(12)]

    def run(engine):
        seqs = [engine.add_sequence(f"b{i}", SamplingParams(), p) for i, p in enumerate(prompts)]
        first = engine.prefill([StepRow(s, p) for s, p in zip(seqs, prompts)])
        out = {i: [first[i].token_id] for i in range(12)}
        for step in range(6):
            if step == 3:
                for s in seqs[2:]:
                    engine.release(s)
            active = range(12) if step < 3 else range(2)
            for i, r in zip(active, engine.step([StepRow(seqs[i]) for i in active])):
                out[i].append(r.token_id)
        return out

    gathered = run(make_engine(model, paged(), max_rows=16))
    storage = paged(decode_attention="mirror")
    assert run(make_engine(model, storage, MIRROR, max_rows=16)) == gathered
    assert storage.mirror.allocations == 2 and storage.mirror.row_capacity == 2
