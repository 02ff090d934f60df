"""PagedKVStorage on a tiny random-weight llama, its block tables and updates coming from a
KVCacheManager as the scheduler's do: parity with dense storage, prefix adoption, copy-on-write,
refusing unreserved positions and in-place pool updates."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from service.core import warm_up
from service.core.engine.config import EngineConfig
from service.core.engine.kv_paged import SlotsNotReservedError, unpack_decode_inputs
from service.core.engine.runner import shape_bucket
from service.core.engine.sampler import SamplingParams
from service.core.kv.block_pool import BlockUpdate, KVCacheManager
from service.core.scheduler.plan import Chunk, RowJoin, RowLeave, StepPlan
from tests.helpers.tiny import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PROMPTS,
    OutOfBlocks,
    StepRow,
    dense,
    generate,
    layout_of,
    make_engine,
    paged,
    prompt,
    run_split,
    step_layout,
    tiny_llama,
)


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return tiny_llama()


def test_paged_matches_dense_tokens_batched_and_alone(model):
    for batched in (True, False):
        outs = {}
        for kind in ("dense", "paged"):
            storage = dense() if kind == "dense" else paged()
            engine = make_engine(model, storage)
            if batched:
                seqs, out = generate(engine, PROMPTS)
            else:
                seqs, out = [], []
                for p in PROMPTS:
                    s, o = generate(engine, [p])
                    seqs += s
                    out += o
            outs[kind] = out
            for s in seqs:
                engine.release(s)
            assert storage.live_sequences == 0
            if engine.manager is not None:
                assert engine.manager.stats().num_active_blocks == 0
        assert outs["paged"] == outs["dense"], f"batched={batched}"
        assert all(len(o) == 21 for o in outs["paged"])


def test_shape_bucket_rounds_up_to_few_lengths():
    assert [shape_bucket(n) for n in (2, 16, 17, 33, 1000, 1024, 1025, 3000)] == [
        16, 16, 32, 64, 1024, 1024, 2048, 3072,
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_shape_buckets_give_the_same_tokens(model, kind):
    """Prefill padded to bucket lengths (masked tail, writes to the scratch slot) must not
    change a single token, batched or alone, with a prefix adopted or not."""
    outs = {}
    for buckets in (False, True):
        storage = dense() if kind == "dense" else paged()
        engine = make_engine(model, storage, EngineConfig(shape_buckets=buckets))
        seqs, out = generate(engine, PROMPTS, tag=f"b{buckets}")
        alone = [generate(engine, [p], tag=f"a{i}")[1][0] for i, p in enumerate(PROMPTS)]
        tokens = prompt(4, 37)
        _, split = run_split(engine, tokens, 16, 6, adopt=False)
        outs[buckets] = (out, alone, split)
        for s in seqs:
            engine.release(s)
    assert outs[True] == outs[False]


def test_a_padded_pass_repeats_its_last_row_and_writes_only_the_scratch_slot(model):
    """With shape buckets a multi-row prefill is padded up to a power of two of rows (copies of
    its last row) where that pass shape was built: the model sees 4 rows for 3 prompts, the
    tokens are the unpadded pass's and the pool outside the scratch block holds what the
    unpadded pass stored (to float noise: the padded shapes run other kernels' blockings)."""
    runs = {}
    for buckets in (False, True):
        storage = paged()
        engine = make_engine(model, storage, EngineConfig(shape_buckets=buckets))
        # The shape a pass is padded to must have run before (as the warm-up runs them).
        assert warm_up.warm_prefill_passes(engine.engine, engine.kv, [(4, 32)]) == 1
        rows_seen: list[int] = []
        hidden = engine.engine._head.hidden

        def spy(tokens, views, adapters, hidden=hidden, rows_seen=rows_seen):
            rows_seen.append(tokens.shape[0])
            return hidden(tokens, views, adapters)

        engine.engine._head.hidden = spy
        _, out = generate(engine, PROMPTS, steps=3, tag="p")
        scratch = storage.scratch_slot
        pools = [np.array(a[:scratch]) for a in storage.pool_arrays()]
        runs[buckets] = (rows_seen[0], out, pools)
    assert runs[False][0] == 3 and runs[True][0] == 4
    assert runs[True][1] == runs[False][1]
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(runs[True][2], runs[False][2]))


def _two_sequences(slots_a: int, slots_b: int):
    """A small pool and two sequences with their block tables holding that many slots."""
    storage = paged(num_blocks=16, block_size=4)
    manager = KVCacheManager(16, 4)
    a, b = storage.new_sequence(), storage.new_sequence()
    table_a, table_b = manager.new_sequence(), manager.new_sequence()
    assert manager.ensure_slots(table_a, slots_a) and manager.ensure_slots(table_b, slots_b)
    return storage, manager, (a, table_a), (b, table_b)


def test_padding_rows_read_their_last_row_and_write_only_the_scratch_slot():
    storage, _, (a, table_a), (b, table_b) = _two_sequences(3, 2)
    step = step_layout([a, b], [0, 0], [3, 2], [table_a.block_ids, table_b.block_ids])
    padded = step.padded_rows(2)
    assert padded.batch_size == 4 and padded.padding_rows == 2
    keys = mx.random.normal((2, KV_HEADS, 3, HEAD_DIM))
    junk = mx.full((2, KV_HEADS, 3, HEAD_DIM), 99.0)  # what the padding rows would write
    k, _ = storage.write_and_gather(
        0, padded, mx.concatenate([keys, junk]), mx.repeat(keys[:1], 4, axis=0)
    )
    stored_b, _ = storage.gather(table_b.block_ids, 0, 2)
    stored_a, _ = storage.gather(table_a.block_ids, 0, 3)
    assert mx.array_equal(stored_a, keys[0]) and mx.array_equal(stored_b, keys[1, :, :2])
    # The padding rows attended over their last row's positions, as it did.
    assert mx.array_equal(k[2, :, :2], k[1, :, :2]) and mx.array_equal(k[3, :, :2], k[1, :, :2])


def _forward_logits(model, storage, handles, tables, starts, rows):
    width = max(len(r) for r in rows)
    tokens = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
    layout = step_layout(list(handles), list(starts), [len(r) for r in rows], tables)
    logits = model(tokens, cache=storage.views(layout, layout_of(model), None, False))
    mx.eval(logits)
    return logits


def test_paged_matches_dense_logits(model):
    """Step 0 (rows of different lengths, nothing cached) attends over the rows' own tokens
    without gathering them from the pool; every later step gathers what the steps wrote."""
    stores = {"dense": dense(), "paged": paged(block_size=4)}
    manager = KVCacheManager(64, 4)
    blocks = [manager.new_sequence() for _ in PROMPTS]
    handles = {k: [s.new_sequence() for _ in PROMPTS] for k, s in stores.items()}
    starts = [0, 0, 0]
    rows = [list(p) for p in PROMPTS]
    assert len({len(r) for r in rows}) > 1  # right padding in the first pass
    gathers: list[int] = []
    gather = stores["paged"].write_and_gather
    stores["paged"].write_and_gather = lambda *a: gathers.append(step) or gather(*a)
    for step in range(4):
        for b, s, r in zip(blocks, starts, rows):
            assert manager.ensure_slots(b, s + len(r))
        stores["paged"].apply(manager.take_update())
        tables = {"dense": [], "paged": [b.block_ids for b in blocks]}
        logits = {
            k: _forward_logits(model, s, handles[k], tables[k], starts, rows)
            for k, s in stores.items()
        }
        assert (step in gathers) == (step > 0), f"step {step}"
        for i, r in enumerate(rows):
            a, b = logits["dense"][i, : len(r)], logits["paged"][i, : len(r)]
            assert mx.abs(a - b).max().item() < 1e-5, f"step {step} row {i}"
        nxt = mx.argmax(logits["paged"][mx.arange(3), mx.array([len(r) - 1 for r in rows])], -1)
        starts = [s + len(r) for s, r in zip(starts, rows)]
        rows = [[t] for t in nxt.tolist()]
    # Every row's stored K/V is the same in both storages.
    for i in range(3):
        for layer in range(LAYERS):
            k_p, v_p = stores["paged"].gather(blocks[i].block_ids, layer, starts[i])
            seq = handles["dense"][i]
            k_d, v_d = seq.keys[layer][:, : starts[i]], seq.values[layer][:, : starts[i]]
            assert mx.array_equal(k_p, k_d) and mx.array_equal(v_p, v_d)


def test_write_and_gather_shapes():
    storage, manager, (a, table_a), (b, table_b) = _two_sequences(7, 3)
    keys = mx.random.normal((1, KV_HEADS, 7, HEAD_DIM))
    step = step_layout([a], [0], [7], [table_a.block_ids])
    k, _ = storage.write_and_gather(0, step, keys, keys)
    assert k.shape == (1, KV_HEADS, 7, HEAD_DIM) and mx.array_equal(k, keys)
    assert manager.ensure_slots(table_a, 8)
    new = mx.random.normal((2, KV_HEADS, 3, HEAD_DIM))
    step = step_layout([a, b], [7, 0], [1, 3], [table_a.block_ids, table_b.block_ids])
    k, _ = storage.write_and_gather(0, step, new, new)
    assert k.shape == (2, KV_HEADS, 8, HEAD_DIM)
    assert mx.array_equal(k[0, :, :7], keys[0]) and mx.array_equal(k[0, :, 7], new[0, :, 0])
    assert mx.array_equal(k[1, :, :3], new[1])
    assert mx.isfinite(k).all().item()
    # Positions past the row's block table are refused, not written anywhere.
    with pytest.raises(SlotsNotReservedError):
        step = step_layout([b], [3], [2], [table_b.block_ids])
        storage.write_and_gather(0, step, new[:1, :, :2], new[:1, :, :2])


def test_prefix_adoption_matches_cold_split_run(model):
    size = 8
    prompt_a = prompt(5, 40)
    prompt_b = prompt_a[:33] + prompt(9, 12)
    storage = paged(num_blocks=64, block_size=size)
    engine = make_engine(model, storage)
    (seq_a,), (out_a,) = generate(engine, [prompt_a], steps=5, tag="a")
    # K/V is stored for the prompt and every generated token but the last.
    assert engine.commit(seq_a, prompt_a + out_a[:-1]) == 5
    engine.release(seq_a)
    manager = engine.manager
    assert manager is not None
    assert manager.stats().num_active_blocks == 0
    assert manager.stats().num_cached_blocks == 5

    seq_b, out_b = run_split(engine, prompt_b, 32, steps=20, adopt=True)
    stats = manager.stats()
    assert (stats.prefix_hits, stats.prefix_hit_tokens) == (1, 32)
    engine.release(seq_b)

    cold = make_engine(model, paged(num_blocks=64, block_size=size))
    _, cold_out = run_split(cold, prompt_b, 32, steps=20)
    assert out_b == cold_out


def test_shared_prefix_blocks_stored_once(model):
    size = 8
    prompt_a = prompt(5, 40)
    prompt_b = prompt_a[:33] + prompt(9, 12)  # 45 tokens
    storage = paged(num_blocks=64, block_size=size)
    engine = make_engine(model, storage)
    (seq_a,), _ = generate(engine, [prompt_a], steps=0, tag="a")
    engine.commit(seq_a, prompt_a)
    manager = engine.manager
    assert manager is not None
    blocks_a = manager.stats().num_active_blocks
    assert blocks_a == 5
    seq_b, _ = run_split(engine, prompt_b, 32, steps=2, adopt=True)
    # B holds ceil(47 / 8) = 6 blocks, of which the first 4 are A's.
    assert engine.blocks(seq_b).block_ids[:4] == engine.blocks(seq_a).block_ids[:4]
    assert manager.stats().num_active_blocks == blocks_a + 6 - 4
    engine.release(seq_a)
    assert manager.stats().num_active_blocks == 6
    engine.release(seq_b)
    assert manager.stats().num_active_blocks == 0


def test_dense_engine_adopts_nothing(model):
    engine = make_engine(model, dense())
    seq = engine.add_sequence("d", SamplingParams(), prompt(1, 20), adopt=True)
    assert seq.num_cached == 0


def _write(storage, manager, handle, table, start, n, seed):
    """Write n random positions at start into every layer; returns what was written."""
    assert manager.ensure_slots(table, start + n)
    storage.apply(manager.take_update())
    kv = mx.random.normal((1, KV_HEADS, n, HEAD_DIM), key=mx.random.key(seed))
    layout = step_layout([handle], [start], [n], [table.block_ids])
    for layer in range(LAYERS):
        storage.write_and_gather(layer, layout, kv, -kv)
    return kv[0]


def test_copy_on_write_keeps_other_sequence_intact():
    """A rolls back into a full block B adopted from the prefix cache, then writes there: A
    gets a copy of the block (the manager's BlockUpdate), B's K/V stay as they were."""
    storage = paged(num_blocks=8, block_size=4)
    manager = KVCacheManager(8, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a, table_a = storage.new_sequence(), manager.new_sequence()
    written_a = _write(storage, manager, a, table_a, 0, 8, seed=1)  # two full blocks
    assert manager.register_full_blocks(table_a, tokens[:8]) == 2
    b, table_b = storage.new_sequence(), manager.new_sequence()
    assert manager.admit(table_b, tokens, True, 0) == 8  # adopts both blocks
    assert table_b.block_ids[:2] == table_a.block_ids
    storage.apply(manager.take_update())
    manager.truncate(table_a, 6)  # a rejected draft: positions 6 and 7 are A's to rewrite
    written_a2 = _write(storage, manager, a, table_a, 6, 1, seed=2)  # shared block: copied
    assert table_a.block_ids[0] == table_b.block_ids[0]
    assert table_a.block_ids[1] != table_b.block_ids[1]
    for layer in range(LAYERS):
        k_a, v_a = storage.gather(table_a.block_ids, layer, 7)
        assert mx.array_equal(k_a[:, :6], written_a[:, :6])
        assert mx.array_equal(v_a[:, :6], -written_a[:, :6])
        assert mx.array_equal(k_a[:, 6], written_a2[:, 0])
        k_b, v_b = storage.gather(table_b.block_ids, layer, 8)
        assert mx.array_equal(k_b, written_a) and mx.array_equal(v_b, -written_a)
    manager.free_sequence(table_a)
    manager.free_sequence(table_b)
    storage.release(a)
    storage.release(b)
    assert manager.stats().num_active_blocks == 0 and storage.live_sequences == 0


def test_unreserved_positions_are_refused_before_any_forward(model):
    """A row whose block table does not cover its positions is the scheduler's bug: the
    engine raises instead of containing it as a row failure, and writes nothing."""
    storage = paged(num_blocks=4, block_size=4)
    engine = make_engine(model, storage)
    runner = engine.engine
    bare = StepPlan(
        -1,
        joins=[RowJoin(0, "bare", SamplingParams(), prompt(1, 6), 0)],
        tables=[(0, [0])],
        prefill=[[Chunk(0, prompt(1, 6), True)]],
    )
    with pytest.raises(SlotsNotReservedError):
        runner.submit(bare)
    assert runner.positions[0] == 0
    runner.collect(runner.submit(StepPlan(-2, leaves=[RowLeave(0, True)])))
    # Through the manager a prompt the pool cannot hold fails before any forward too.
    big = engine.add_sequence("big", SamplingParams(), prompt(1, 17))
    with pytest.raises(OutOfBlocks):
        engine.prefill([StepRow(big, prompt(1, 17))])
    assert big.num_cached == 0
    engine.release(big)
    seqs, _ = generate(engine, [prompt(2, 5), prompt(3, 4)], steps=3)
    assert engine.manager is not None
    assert engine.manager.stats().num_active_blocks == 4  # 2 blocks each (8 and 7 positions)
    for s in seqs:
        engine.release(s)
    assert engine.manager.stats().num_active_blocks == 0 and storage.live_sequences == 0


def test_block_update_grows_the_arrays_and_keeps_data():
    storage = paged(num_blocks=64, block_size=4, initial_blocks=2)
    manager = KVCacheManager(64, 4, capacity=2)
    a, table = storage.new_sequence(), manager.new_sequence()
    written = _write(storage, manager, a, table, 0, 8, seed=3)
    assert storage.capacity_blocks == 2
    _write(storage, manager, a, table, 8, 9, seed=4)  # needs blocks 2..4: capacity doubles
    assert storage.capacity_blocks == manager.pool.capacity >= 5
    k, _ = storage.gather(table.block_ids, 0, 8)
    assert mx.array_equal(k, written)
    storage.apply(BlockUpdate(capacity=1000))  # never past the pool's blocks
    assert storage.capacity_blocks == 64
    # A table naming blocks the arrays do not cover yet (its update not applied) is refused.
    small = paged(num_blocks=64, block_size=4, initial_blocks=2)
    step = step_layout([small.new_sequence()], [0], [1], [[5]])
    one = mx.zeros((1, KV_HEADS, 1, HEAD_DIM))
    with pytest.raises(SlotsNotReservedError, match="update"):
        small.write_and_gather(0, step, one, one)


def test_decode_step_updates_pool_in_place(model):
    """A synchronous step must not copy the pool (MLX donates the buffer to the scatter)."""
    storage = paged(num_blocks=2048, block_size=8, initial_blocks=2048)  # 1 MiB per K or V
    engine = make_engine(model, storage)
    seqs, _ = generate(engine, PROMPTS, steps=2)
    pool_bytes = storage._keys[0].nbytes
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    engine.step([StepRow(s) for s in seqs])
    mx.synchronize()
    assert mx.get_peak_memory() - base < pool_bytes // 2


def test_physical_pool_grows_on_demand_and_keeps_data(model):
    """A large budget allocates little until used; growing keeps every sequence's K/V."""
    storage = paged(num_blocks=1024, block_size=8, initial_blocks=2)
    assert storage.reserved_bytes == 3 * storage.bytes_per_block
    engine = make_engine(model, storage)
    _, tokens = generate(engine, PROMPTS, steps=6)
    assert storage.reserved_bytes > 3 * storage.bytes_per_block
    assert engine.manager is not None and storage.capacity_blocks == engine.manager.pool.capacity
    reference = make_engine(model, dense())
    _, expected = generate(reference, PROMPTS, steps=6)
    assert tokens == expected


def test_the_slot_table_maps_each_position_through_its_rows_blocks():
    """Row i's position p reads slot table[p // size] * size + p % size up to its end, and the
    scratch slot past it, also where the span is padded beyond every row's blocks."""
    size = 8
    storage = paged(num_blocks=64, block_size=size)
    rng = np.random.default_rng(3)
    totals = [1, 8, 9, 23, 40]
    tables = [rng.choice(64, -(-t // size), replace=False).tolist() for t in totals]
    for pad_span in (0, 64):  # 64: five blocks' worth past the widest table
        step = step_layout([None] * len(totals), [t - 1 for t in totals], [1] * 5, tables)
        step.pad_span = pad_span
        read = storage.slot_table(step)
        assert read.shape == (len(totals), max(pad_span, max(totals)))
        for i, (total, blocks) in enumerate(zip(totals, tables)):
            for p in range(read.shape[1]):
                want = blocks[p // size] * size + p % size if p < total else storage.scratch_slot
                assert read[i, p] == want, (i, p)
    with pytest.raises(SlotsNotReservedError):
        storage.slot_table(step_layout([None], [8], [1], [tables[0]]))  # 9 positions, one block


def test_a_steps_write_slots_are_the_slot_tables_at_its_new_positions():
    """Each new token is written to the slot the table maps its position to; positions past a
    row's new tokens (a padded width) and padding rows write only the scratch slot."""
    size = 8
    storage = paged(num_blocks=64, block_size=size)
    rng = np.random.default_rng(4)
    starts, lengths = [0, 7, 16, 30], [5, 2, 1, 10]
    tables = [
        rng.choice(64, -(-(s + n) // size), replace=False).tolist() for s, n in zip(starts, lengths)
    ]
    step = step_layout([None] * 4, starts, lengths, tables).padded_rows(1)
    step.pad_width = 12
    read = storage.slot_table(step)
    write = storage._step_plan(0, step).write_slots.reshape(5, step.width)
    for i, (start, n) in enumerate(zip(starts, lengths)):
        for j in range(step.width):
            want = read[i, start + j] if j < n else storage.scratch_slot
            assert write[i, j] == want, (i, j)
    assert (write[4] == storage.scratch_slot).all()  # the padding row


def test_decode_inputs_pack_each_rows_block_table():
    """The compiled decode step's packed plan: offset, length, the new token's slot and the
    block table, which maps each position as the slot table does; padding rows and columns
    past the tables hold the scratch block; the width is a whole number of `bucket` positions."""
    size = 8
    storage = paged(num_blocks=64, block_size=size)
    rng = np.random.default_rng(5)
    totals = [1, 8, 9, 23, 40]
    tables = [rng.choice(64, -(-t // size), replace=False).tolist() for t in totals]
    step = step_layout([None] * len(totals), [t - 1 for t in totals], [1] * 5, tables)
    packed = storage.decode_inputs(step, 32, 8)
    assert packed.shape == (8 * (3 + 64 // size),)  # 40 positions -> 64, the next 32 bucket
    offsets, lengths, write, blocks = map(np.asarray, unpack_decode_inputs(packed, 8))
    assert blocks.shape == (8, 64 // size)
    read = storage.slot_table(step)
    scratch_block = storage.scratch_slot // size
    for i, total in enumerate(totals):
        assert offsets[i] == total - 1 and lengths[i] == total
        assert write[i] == read[i, total - 1]
        for p in range(total):
            assert blocks[i, p // size] * size + p % size == read[i, p]
    assert (blocks[:, 5:] == scratch_block).all()  # past the widest table (5 blocks)
    assert (offsets[5:] == 0).all() and (lengths[5:] == 1).all()
    assert (write[5:] == storage.scratch_slot).all()
    assert (blocks[5:] == scratch_block).all()
    with pytest.raises(SlotsNotReservedError):
        storage.decode_inputs(step_layout([None], [8], [1], [tables[0]]), 32, 1)


def test_new_kv_held_for_an_attention_that_never_takes_them_raise_at_the_forwards_end():
    """A direct step's in-place write holds the layer's new K/V for its attention kernel; a
    last layer whose attention did not take them would drop them silently: the end of the
    forward raises instead."""
    storage = paged(decode_attention="direct", in_place=True)
    storage.apply(BlockUpdate(capacity=4))
    handles = [storage.new_sequence() for _ in range(2)]
    batch = step_layout(handles, [3, 5], [1, 1], [[0], [1]])
    kv = mx.zeros((2, KV_HEADS, 1, HEAD_DIM))
    storage.write(LAYERS - 1, batch, kv, kv)
    with pytest.raises(RuntimeError, match="never written"):
        storage.end_forward()
    storage.end_forward()  # raised once: nothing is held any more
