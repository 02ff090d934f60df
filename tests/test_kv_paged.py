"""PagedKVStorage on a tiny random-weight llama: parity with dense storage, prefix adoption,
copy-on-write, out-of-blocks handling and in-place pool updates."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from service.engine.batch_view import StepLayout, make_views
from service.engine.config import EngineConfig
from service.engine.engine import StepRow, shape_bucket
from service.engine.kv_paged import OutOfBlocksError
from service.engine.sampler import SamplingParams
from tests.tiny import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    PROMPTS,
    dense,
    generate,
    layout_of,
    make_engine,
    paged,
    prompt,
    run_split,
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
            if kind == "paged":
                assert storage.stats().num_active_blocks == 0
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


def _forward_logits(model, storage, handles, starts, rows):
    if hasattr(storage, "ensure_reserved"):
        for h, s, r in zip(handles, starts, rows):
            assert storage.ensure_reserved(h, s + len(r))
    width = max(len(r) for r in rows)
    tokens = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
    layout = StepLayout(list(handles), list(starts), [len(r) for r in rows])
    logits = model(tokens, cache=make_views(storage, layout_of(model), layout))
    mx.eval(logits)
    return logits


def test_paged_matches_dense_logits(model):
    stores = {"dense": dense(), "paged": paged(block_size=4)}
    handles = {k: [s.new_sequence() for _ in PROMPTS] for k, s in stores.items()}
    starts = [0, 0, 0]
    rows = [list(p) for p in PROMPTS]
    for step in range(4):
        logits = {k: _forward_logits(model, s, handles[k], starts, rows) for k, s in stores.items()}
        for i, r in enumerate(rows):
            a, b = logits["dense"][i, : len(r)], logits["paged"][i, : len(r)]
            assert mx.abs(a - b).max().item() < 1e-5, f"step {step} row {i}"
        nxt = mx.argmax(logits["paged"][mx.arange(3), mx.array([len(r) - 1 for r in rows])], -1)
        starts = [s + len(r) for s, r in zip(starts, rows)]
        rows = [[t] for t in nxt.tolist()]
    # Every row's stored K/V is the same in both storages.
    for i in range(3):
        for layer in range(LAYERS):
            k_p, v_p = stores["paged"].gather(handles["paged"][i], layer, starts[i])
            seq = handles["dense"][i]
            k_d, v_d = seq.keys[layer][:, : starts[i]], seq.values[layer][:, : starts[i]]
            assert mx.array_equal(k_p, k_d) and mx.array_equal(v_p, v_d)


def test_write_and_gather_shapes():
    storage = paged(num_blocks=16, block_size=4)
    a, b = storage.new_sequence(), storage.new_sequence()
    assert storage.reserve(a, 7) and storage.reserve(b, 3)
    keys = mx.random.normal((1, KV_HEADS, 7, HEAD_DIM))
    k, _ = storage.write_and_gather(0, StepLayout([a], [0], [7]), keys, keys)
    assert k.shape == (1, KV_HEADS, 7, HEAD_DIM) and mx.array_equal(k, keys)
    assert storage.reserve(a, 1)
    new = mx.random.normal((2, KV_HEADS, 3, HEAD_DIM))
    k, _ = storage.write_and_gather(0, StepLayout([a, b], [7, 0], [1, 3]), new, new)
    assert k.shape == (2, KV_HEADS, 8, HEAD_DIM)
    assert mx.array_equal(k[0, :, :7], keys[0]) and mx.array_equal(k[0, :, 7], new[0, :, 0])
    assert mx.array_equal(k[1, :, :3], new[1])
    assert mx.isfinite(k).all().item()
    with pytest.raises(ValueError, match="reserved"):
        storage.write_and_gather(0, StepLayout([b], [3], [2]), new[:1, :, :2], new[:1, :, :2])


def test_prefix_adoption_matches_cold_split_run(model):
    size = 8
    prompt_a = prompt(5, 40)
    prompt_b = prompt_a[:33] + prompt(9, 12)
    storage = paged(num_blocks=64, block_size=size)
    engine = make_engine(model, storage)
    (seq_a,), (out_a,) = generate(engine, [prompt_a], steps=5, tag="a")
    # K/V is stored for the prompt and every generated token but the last.
    assert storage.commit_tokens(seq_a.kv, prompt_a + out_a[:-1]) == 5
    engine.release(seq_a)
    assert storage.stats().num_active_blocks == 0
    assert storage.stats().num_cached_blocks == 5

    seq_b, out_b = run_split(engine, prompt_b, 32, steps=20, adopt=True)
    stats = storage.stats()
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
    storage.commit_tokens(seq_a.kv, prompt_a)
    blocks_a = storage.stats().num_active_blocks
    assert blocks_a == 5
    seq_b, _ = run_split(engine, prompt_b, 32, steps=2, adopt=True)
    # B holds ceil(47 / 8) = 6 blocks, of which the first 4 are A's.
    assert seq_b.kv.block_ids[:4] == seq_a.kv.block_ids[:4]
    assert storage.stats().num_active_blocks == blocks_a + 6 - 4
    assert storage.used_bytes == (blocks_a + 2) * storage.bytes_per_block
    engine.release(seq_a)
    assert storage.stats().num_active_blocks == 6
    engine.release(seq_b)
    assert storage.stats().num_active_blocks == 0


def test_dense_engine_adopts_nothing(model):
    engine = make_engine(model, dense())
    seq = engine.add_sequence("d", SamplingParams(), prompt(1, 20))
    assert engine.adopt_prefix(seq, prompt(1, 20)) == 0 and seq.num_cached == 0


def _write(storage, handle, start, n, seed):
    """Write n random positions at start into every layer; returns what was written."""
    assert storage.ensure_reserved(handle, start + n)
    kv = mx.random.normal((1, KV_HEADS, n, HEAD_DIM), key=mx.random.key(seed))
    layout = StepLayout([handle], [start], [n])
    for layer in range(LAYERS):
        storage.write_and_gather(layer, layout, kv, -kv)
    return kv[0]


def test_copy_on_write_keeps_other_sequence_intact():
    storage = paged(num_blocks=8, block_size=4)
    a = storage.new_sequence()
    written_a = _write(storage, a, 0, 6, seed=1)  # blocks: [full, half]
    b = storage.fork(a)
    assert b.block_ids == a.block_ids and storage.stats().num_active_blocks == 2
    written_b = _write(storage, b, 6, 1, seed=2)  # lands in the shared half block -> copy
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    assert storage.stats().num_active_blocks == 3
    for layer in range(LAYERS):
        k_a, v_a = storage.gather(a, layer, 6)
        assert mx.array_equal(k_a, written_a) and mx.array_equal(v_a, -written_a)
        k_b, _ = storage.gather(b, layer, 7)
        assert mx.array_equal(k_b[:, :6], written_a) and mx.array_equal(k_b[:, 6], written_b[:, 0])
    # A now holds its half block alone: it writes in place and B keeps its own position 6.
    written_a2 = _write(storage, a, 6, 1, seed=3)
    assert storage.stats().num_active_blocks == 3
    for layer in range(LAYERS):
        k_a, _ = storage.gather(a, layer, 7)
        k_b, _ = storage.gather(b, layer, 7)
        assert mx.array_equal(k_a[:, 6], written_a2[:, 0])
        assert mx.array_equal(k_b[:, 6], written_b[:, 0])
    storage.release(a)
    storage.release(b)
    assert storage.stats().num_active_blocks == 0 and storage.live_sequences == 0


def test_out_of_blocks_is_all_or_nothing_and_nothing_leaks(model):
    storage = paged(num_blocks=4, block_size=4)
    a, b = storage.new_sequence(), storage.new_sequence()
    assert storage.reserve(a, 10)  # 3 blocks
    assert not storage.can_reserve(b, 8)
    assert not storage.reserve(b, 8)
    assert b.block_ids == [] and b.num_reserved == 0
    assert storage.stats().num_free_blocks == 1
    assert storage.reserve(b, 4)
    storage.release(a)
    assert storage.stats().num_free_blocks == 3
    assert storage.reserve(b, 8)
    storage.release(b)
    assert storage.stats().num_active_blocks == 0

    # Through the engine: a prompt the pool cannot hold fails before any forward.
    engine = make_engine(model, storage)
    big = engine.add_sequence("big", SamplingParams(), prompt(1, 17))
    with pytest.raises(OutOfBlocksError):
        engine.prefill([StepRow(big, prompt(1, 17))])
    assert big.num_cached == 0
    engine.release(big)
    seqs, _ = generate(engine, [prompt(2, 5), prompt(3, 4)], steps=3)
    assert storage.stats().num_active_blocks == 4  # 2 blocks each (8 and 7 positions)
    extra = engine.add_sequence("extra", SamplingParams(), prompt(4, 3))
    with pytest.raises(OutOfBlocksError):
        engine.prefill([StepRow(extra, prompt(4, 3))])
    for s in [*seqs, extra]:
        engine.release(s)
    assert storage.stats().num_active_blocks == 0 and storage.live_sequences == 0


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
    reference = make_engine(model, dense())
    _, expected = generate(reference, PROMPTS, steps=6)
    assert tokens == expected
