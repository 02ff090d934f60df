"""Decode attention read straight from the paged pool (service.core.engine.paged_attention).

On the CPU the MLX-ops reference runs (and the engine's direct decode path through it); the
CUDA kernel is checked against the reference where MLX's CUDA backend is present."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from service.core.engine import paged_attention
from service.core.engine.config import EngineConfig
from service.core.engine.kv_paged import PagedKVStorage
from service.core.engine.paged_attention import (
    NewKV,
    _reference,
    paged_decode_attention,
    store_decode_kv,
)
from service.core.engine.sampler import SamplingParams
from service.core.models import rope
from tests.helpers import cuda_source
from tests.helpers.attention import naive, random_case
from tests.helpers.tiny import (
    LAYERS,
    PROMPTS,
    StepRow,
    dense,
    generate,
    make_engine,
    paged,
    tiny_llama,
)

cuda_only = pytest.mark.skipif(
    not paged_attention.kernel_available(), reason="needs MLX's CUDA backend"
)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 8)])
def test_reference_matches_naive_attention(head_dim, heads, kv_heads, window):
    lengths = [1, 37, 5, 300]
    case = random_case(len(lengths), heads, kv_heads, head_dim, lengths, mx.float32)
    scale = 1 / math.sqrt(head_dim)
    got = _reference(*case, scale, window)
    want = naive(*case, scale, window)
    assert mx.abs(got - want).max().item() < 1e-4


@cuda_only
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(
    "head_dim,heads,kv_heads", [(64, 9, 3), (64, 32, 8), (128, 32, 8), (256, 16, 8)]
)
def test_cuda_kernel_matches_reference(dtype, head_dim, heads, kv_heads, window):
    lengths = [1, 37, 5, 300, 1029, 64]
    case = random_case(len(lengths), heads, kv_heads, head_dim, lengths, dtype)
    scale = 1 / math.sqrt(head_dim)
    got = paged_decode_attention(*case, scale, window=window).astype(mx.float32)
    want = naive(*case, scale, window)
    tolerance = 2e-2 if dtype == mx.bfloat16 else 1e-4
    assert mx.abs(got - want).max().item() < tolerance


@pytest.mark.parametrize("window", [None, 20])
def test_a_block_table_reads_the_slots_it_maps(window):
    """With `block`, each row's table holds block ids and position t reads slot
    table[t // block] * block + t % block (the kernel on CUDA, the reference elsewhere)."""
    block, heads, kv_heads, head_dim = 16, 8, 2, 64
    lengths = [1, 16, 17, 100, 45]
    num_blocks = 40
    mx.random.seed(4)
    k_pool = mx.random.normal((num_blocks * block, kv_heads, head_dim))
    v_pool = mx.random.normal((num_blocks * block, kv_heads, head_dim))
    queries = mx.random.normal((len(lengths), heads, 1, head_dim))
    width = -(-max(lengths) // block)
    perm = mx.random.permutation(num_blocks).tolist()
    tables, used = [], 0
    for n in lengths:
        own = -(-n // block)
        tables.append(perm[used : used + own] + [num_blocks - 1] * (width - own))
        used += own
    table = mx.array(tables, dtype=mx.int32)
    slots = (table[:, :, None] * block + mx.arange(block)).reshape(len(lengths), -1)
    lens = mx.array(lengths, dtype=mx.int32)
    scale = 1 / math.sqrt(head_dim)
    got = paged_decode_attention(
        queries, k_pool, v_pool, table, lens, scale, window=window, block=block
    )
    want = naive(queries, k_pool, v_pool, slots, lens, scale, window)
    assert mx.abs(got - want).max().item() < 1e-4


def test_direct_decode_gives_the_same_tokens_as_gathering(model):
    outs = {}
    for direct in (False, True):
        attention = "direct" if direct else "gather"
        storage = paged(decode_attention=attention)
        engine = make_engine(model, storage, EngineConfig(decode_attention=attention))
        seqs, out = generate(engine, PROMPTS, tag=f"d{direct}")
        outs[direct] = out
        for s in seqs:
            engine.release(s)
    assert outs[True] == outs[False]


def test_direct_decode_needs_paged_storage(model):
    with pytest.raises(ValueError, match="paged storage"):
        make_engine(model, dense(), EngineConfig(decode_attention="direct"))


@cuda_only
def test_in_place_write_lands_in_its_slots_before_attention_reads_them():
    kv_heads, heads, head_dim = 2, 4, 64
    k_pool = mx.zeros((40, kv_heads, head_dim), dtype=mx.bfloat16)
    v_pool = mx.zeros((40, kv_heads, head_dim), dtype=mx.bfloat16)
    mx.eval(k_pool, v_pool)
    mx.random.seed(5)
    keys = mx.random.normal((3, kv_heads, 1, head_dim)).astype(mx.bfloat16)
    values = mx.random.normal((3, kv_heads, 1, head_dim)).astype(mx.bfloat16)
    queries = mx.random.normal((3, heads, 1, head_dim)).astype(mx.bfloat16)
    slots = mx.array([7, 0, 33], dtype=mx.int32)
    done = store_decode_kv(k_pool, v_pool, keys, values, slots, mx.ones(3, mx.int32))
    # One position per row: attention returns that position's value, so it must see the
    # write queued in the same graph (ordered by `after`), not the zeros before it.
    out = paged_decode_attention(
        queries, k_pool, v_pool, slots[:, None], mx.ones(3, mx.int32), 0.125, after=done
    )
    group = heads // kv_heads
    want = mx.repeat(values, group, axis=1)
    assert mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item() < 1e-2
    assert mx.array_equal(k_pool[slots], keys[:, :, 0]).item()
    assert mx.array_equal(v_pool[slots], values[:, :, 0]).item()
    others = mx.array([i for i in range(40) if i not in (7, 0, 33)])
    assert mx.abs(k_pool[others]).max().item() == 0


@cuda_only
def test_kernels_read_strided_inputs_through_their_strides():
    """The kernels take their inputs as they come (no copy per layer): K/V and queries that
    are views of a fused q/k/v product, slots and lengths that are columns of a packed plan."""
    rows, heads, kv_heads, head_dim, block = 5, 8, 2, 64, 4
    mx.random.seed(6)
    fused = mx.random.normal((rows, 1, (heads + 2 * kv_heads) * head_dim)).astype(mx.bfloat16)
    q, k, v = mx.split(fused, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
    queries, keys, values = (
        part.reshape(rows, 1, n, head_dim).transpose(0, 2, 1, 3)
        for part, n in ((q, heads), (k, kv_heads), (v, kv_heads))
    )
    k_pool = mx.random.normal((80, kv_heads, head_dim)).astype(mx.bfloat16)
    v_pool = mx.random.normal((80, kv_heads, head_dim)).astype(mx.bfloat16)
    lengths = [1, 5, 9, 3, 12]
    tables = [[2 * r + 1, 2 * r + 2, 13 + r] for r in range(rows)]
    write_slots = [
        tables[r][(n - 1) // block] * block + (n - 1) % block for r, n in enumerate(lengths)
    ]
    plan = mx.array([[n, s, *t] for n, s, t in zip(lengths, write_slots, tables)], dtype=mx.int32)
    lens, write, table = plan[:, 0], plan[:, 1], plan[:, 2:]  # strided columns
    k_want, v_want = k_pool * 1, v_pool * 1  # copies, for the reference
    mx.eval(k_pool, v_pool, k_want, v_want)
    k_want[mx.array(write_slots)] = keys[:, :, 0]
    v_want[mx.array(write_slots)] = values[:, :, 0]
    done = store_decode_kv(k_pool, v_pool, keys, values, write, lens)
    got = paged_decode_attention(
        queries, k_pool, v_pool, table, lens, 0.125, after=done, block=block
    ).astype(mx.float32)
    mx.eval(got)  # runs the write too (`after`); the pools' arrays do not depend on it
    slots = (mx.array(tables)[:, :, None] * block + mx.arange(block)).reshape(rows, -1)
    want = naive(queries, k_want, v_want, slots, mx.array(lengths), 0.125, None)
    assert mx.array_equal(k_pool, k_want).item() and mx.array_equal(v_pool, v_want).item()
    assert mx.abs(got - want.astype(mx.float32)).max().item() < 2e-2


@cuda_only
@pytest.mark.parametrize(
    "module",
    [
        nn.RoPE(64),
        nn.RoPE(32, traditional=True, base=500000.0, scale=0.5),
        Llama3RoPE(64, base=500000.0, scaling_config={"factor": 8.0}),
    ],
    ids=["plain", "traditional-partial", "llama3"],
)
def test_kernels_apply_a_deferred_rope_as_mlx_does(module: nn.Module) -> None:
    """A step's RoPE left to the kernels (service.core.models.rope.DeferredRoPE): the K/V
    store rotates the keys, the attention the queries, each row's token at position
    length - 1, as MLX's RoPE would have before them."""
    rotation = rope.rotation_of(module)
    rows, heads, kv_heads, head_dim = 4, 8, 2, 64
    mx.random.seed(8)
    queries = mx.random.normal((rows, heads, 1, head_dim)).astype(mx.bfloat16)
    keys = mx.random.normal((rows, kv_heads, 1, head_dim)).astype(mx.bfloat16)
    values = mx.random.normal((rows, kv_heads, 1, head_dim)).astype(mx.bfloat16)
    lengths = mx.array([1, 6, 40, 1000], dtype=mx.int32)
    write = mx.array([3, 9, 27, 50], dtype=mx.int32)
    pools = [mx.zeros((64, kv_heads, head_dim), mx.bfloat16) for _ in range(4)]
    mx.eval(pools)
    k_got, v_got, k_want, v_want = pools
    done = store_decode_kv(k_got, v_got, keys, values, write, lengths, rotation)
    mx.eval(done)
    rotated_keys = module(keys, offset=lengths - 1)
    # The in-place write runs when its returned array is evaluated, not the pool.
    mx.eval(store_decode_kv(k_want, v_want, rotated_keys, values, write, lengths))
    ulp = 2.0**-7 * mx.abs(k_want[write].astype(mx.float32)) + 1e-6
    assert (mx.abs(k_got[write] - k_want[write]).astype(mx.float32) <= ulp).all().item()
    # Attention over a random pool: every row reads slots 0.. of it, up to its length, its
    # query at position length - 1.
    k_pool = mx.random.normal((64, kv_heads, head_dim)).astype(mx.bfloat16)
    v_pool = mx.random.normal((64, kv_heads, head_dim)).astype(mx.bfloat16)
    spans = mx.array([1, 5, 17, 33], dtype=mx.int32)
    slots = mx.broadcast_to(mx.arange(40, dtype=mx.int32), (rows, 40))
    got = paged_decode_attention(queries, k_pool, v_pool, slots, spans, 0.125, rotation=rotation)
    rotated = module(queries, offset=spans - 1)
    want = paged_decode_attention(rotated, k_pool, v_pool, slots, spans, 0.125)
    unrotated = paged_decode_attention(queries, k_pool, v_pool, slots, spans, 0.125)
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 2e-2
    assert mx.abs(unrotated.astype(mx.float32) - want.astype(mx.float32)).max().item() > 0.1


@cuda_only
@pytest.mark.parametrize("rotated", [False, True])
def test_the_attention_writes_the_new_kv_as_the_store_kernel_would(rotated: bool) -> None:
    """`store=`: the attention kernel writes the step's new K/V in place (one block per K/V
    head) and reads each row's newest position from them: the pools and the output equal the
    store kernel's write followed by the attention."""
    rows, heads, kv_heads, head_dim, block = 4, 8, 2, 64, 4
    rotation = rope.rotation_of(nn.RoPE(head_dim)) if rotated else None
    mx.random.seed(9)
    queries = mx.random.normal((rows, heads, 1, head_dim)).astype(mx.bfloat16)
    keys = mx.random.normal((rows, kv_heads, 1, head_dim)).astype(mx.bfloat16)
    values = mx.random.normal((rows, kv_heads, 1, head_dim)).astype(mx.bfloat16)
    lengths = mx.array([1, 4, 7, 12], dtype=mx.int32)
    tables = mx.array([[4 * r + 1, 4 * r + 2, 4 * r + 3] for r in range(rows)], dtype=mx.int32)
    last = lengths - 1
    write = mx.take_along_axis(tables, (last // block)[:, None], axis=1)[:, 0] * block + (
        last % block
    )
    # Every slot the tables name (blocks up to 4 * rows - 1) lies inside the pools.
    start = mx.random.normal((4 * rows * block, kv_heads, head_dim)).astype(mx.bfloat16)
    k_a, v_a, k_b, v_b = (start * 1 for _ in range(4))
    mx.eval(k_a, v_a, k_b, v_b)
    done = store_decode_kv(k_a, v_a, keys, values, write, lengths, rotation)
    want = paged_decode_attention(
        queries, k_a, v_a, tables, lengths, 0.125, after=done, block=block, rotation=rotation
    )
    mx.eval(want)
    got = paged_decode_attention(
        queries,
        k_b,
        v_b,
        tables,
        lengths,
        0.125,
        block=block,
        rotation=rotation,
        store=NewKV(keys, values, write),
    )
    mx.eval(got)
    assert mx.array_equal(k_b, k_a).item() and mx.array_equal(v_b, v_a).item()
    assert mx.array_equal(got, want).item()


@cuda_only
@pytest.mark.parametrize("compiled", [False, True])
def test_overlapped_steps_with_in_place_writes_give_the_gathered_tokens(compiled):
    """Step N+1 queued before step N is read (as the scheduler does with overlap_steps), rows
    of different lengths, a row leaving half-way: the same greedy tokens as gathering, with
    the steps built op by op or replayed from compiled graphs."""
    model = tiny_llama(hidden_size=128, heads=2, kv_heads=1, seed=11)  # head_dim 64
    outs = {}
    for overlap in (False, True):
        storage = PagedKVStorage(
            LAYERS,
            1,
            64,
            mx.float32,
            num_blocks=64,
            block_size=8,
            decode_attention="direct" if overlap else "gather",
            in_place=overlap,
        )
        config = EngineConfig(
            decode_attention="direct" if overlap else "gather",
            in_place_writes=overlap,
            overlap_steps=overlap,
            compile_decode=overlap and compiled,
        )
        engine = make_engine(model, storage, config)
        seqs = [engine.add_sequence(f"o{i}", SamplingParams(), p) for i, p in enumerate(PROMPTS)]
        out = [[r.token_id] for r in engine.prefill([StepRow(s, p) for s, p in zip(seqs, PROMPTS)])]
        live = list(range(len(seqs)))
        pending = engine.submit([StepRow(seqs[i]) for i in live])
        for n in range(24):
            if n == 12:
                live = live[1:]  # the first row leaves: its step in flight is still read
            nxt = engine.submit([StepRow(seqs[i]) for i in live], dispatch=overlap)
            for r in engine.finish_rows(pending):
                out[next(i for i, s in enumerate(seqs) if s is r.seq)].append(r.token_id)
            if not overlap:
                engine.dispatch(nxt)
            pending = nxt
        engine.finish_rows(pending)
        outs[overlap] = out
    assert outs[True] == outs[False]


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_kernels_source_compiles(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode attention and in-place K/V write kernels, launched by their own host code
    (three dtypes, head dims 64 and 128, grouped heads, paged blocks, a window, RoPE over a
    whole head and over half of one, traditional; the attention writing the new K/V itself too)
    and compiled
    by nvcc as MLX wraps them: no error, no spill."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(paged_attention, "kernel_available", lambda: True)
    monkeypatch.setattr(paged_attention, "_kernel", paged_attention._kernel.__wrapped__)
    monkeypatch.setattr(paged_attention, "_store_kernel", paged_attention._store_kernel.__wrapped__)
    plain = rope.rotation_of(nn.RoPE(64))
    partial = rope.rotation_of(nn.RoPE(64, traditional=True))  # 64 of a head's 128 dims
    cases = [(mx.bfloat16, 64, 9, 3, 1, None, plain), (mx.float16, 128, 8, 8, 16, 512, partial)]
    cases += [(mx.float32, 64, 4, 1, 1, None, None)]
    for dtype, head_dim, heads, kv_heads, block, window, rotation in cases:
        q = mx.zeros((2, heads, 1, head_dim), dtype)
        pool = mx.zeros((64, kv_heads, head_dim), dtype)
        slots, lengths = mx.zeros((2, 4), mx.int32), mx.zeros((2,), mx.int32)
        keys = mx.zeros((2, kv_heads, 1, head_dim), dtype)
        done = store_decode_kv(pool, pool, keys, pool, slots[:, 0], lengths, rotation)
        values = mx.zeros((2, kv_heads, 1, head_dim), dtype)
        # after the store kernel, and writing the new K/V itself
        for after, store in ((done, None), (None, NewKV(keys, values, slots[:, 0]))):
            paged_decode_attention(
                q,
                pool,
                pool,
                slots,
                lengths,
                0.125,
                after=after,
                window=window,
                block=block,
                rotation=rotation,
                store=store,
            )
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == 3 * len(cases), compiled.log
    assert compiled.spills == 0, compiled.log
