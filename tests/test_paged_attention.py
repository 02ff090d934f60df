"""Decode attention read straight from the paged pool (service.engine.paged_attention).

On the CPU the MLX-ops reference runs (and the engine's direct decode path through it); the
CUDA kernel is checked against the reference where MLX's CUDA backend is present."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from service.engine import paged_attention
from service.engine.engine import Engine
from service.engine.paged_attention import _reference, paged_decode_attention
from tests.test_kv_paged import LAYERS, PROMPTS, dense, generate, paged, tiny_llama


def random_case(batch: int, heads: int, kv_heads: int, head_dim: int, lengths: list[int], dtype):
    mx.random.seed(3)
    num_slots = sum(lengths) + 8
    k_pool = mx.random.normal((num_slots, kv_heads, head_dim)).astype(dtype)
    v_pool = mx.random.normal((num_slots, kv_heads, head_dim)).astype(dtype)
    queries = mx.random.normal((batch, heads, 1, head_dim)).astype(dtype)
    # Each row's positions live in scattered slots; padding points at the last slot.
    perm = mx.random.permutation(num_slots - 1).tolist()
    width = max(lengths)
    slots, used = [], 0
    for n in lengths:
        row = perm[used : used + n] + [num_slots - 1] * (width - n)
        used += n
        slots.append(row)
    return queries, k_pool, v_pool, mx.array(slots, dtype=mx.int32), mx.array(lengths, mx.int32)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def naive(queries, k_pool, v_pool, slots, lengths, scale) -> mx.array:
    """Row by row, head by head, in float32."""
    batch, heads = queries.shape[:2]
    group = heads // k_pool.shape[1]
    out = []
    for b in range(batch):
        n = lengths[b].item()
        idx = slots[b, :n]
        rows = []
        for h in range(heads):
            k = k_pool[idx, h // group].astype(mx.float32)  # [n, D]
            v = v_pool[idx, h // group].astype(mx.float32)
            q = queries[b, h, 0].astype(mx.float32)
            weights = mx.softmax((k @ q) * scale)
            rows.append(weights @ v)
        out.append(mx.stack(rows)[:, None, :])
    return mx.stack(out)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 8)])
def test_reference_matches_naive_attention(head_dim, heads, kv_heads):
    lengths = [1, 37, 5, 300]
    case = random_case(len(lengths), heads, kv_heads, head_dim, lengths, mx.float32)
    scale = 1 / math.sqrt(head_dim)
    got = _reference(*case, scale)
    want = naive(*case, scale)
    assert mx.abs(got - want).max().item() < 1e-4


@pytest.mark.skipif(not paged_attention.kernel_available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (64, 32, 8), (128, 32, 8)])
def test_cuda_kernel_matches_reference(dtype, head_dim, heads, kv_heads):
    lengths = [1, 37, 5, 300, 1029, 64]
    case = random_case(len(lengths), heads, kv_heads, head_dim, lengths, dtype)
    scale = 1 / math.sqrt(head_dim)
    got = paged_decode_attention(*case, scale).astype(mx.float32)
    want = naive(*case, scale)
    tolerance = 2e-2 if dtype == mx.bfloat16 else 1e-4
    assert mx.abs(got - want).max().item() < tolerance


def test_direct_decode_gives_the_same_tokens_as_gathering(model):
    outs = {}
    for direct in (False, True):
        storage = paged()
        engine = Engine(model, storage, LAYERS, direct_decode=direct)
        seqs, out = generate(engine, PROMPTS, tag=f"d{direct}")
        outs[direct] = out
        for s in seqs:
            engine.release(s)
    assert outs[True] == outs[False]


def test_direct_decode_needs_paged_storage(model):
    with pytest.raises(ValueError, match="paged storage"):
        Engine(model, dense(), LAYERS, direct_decode=True)
