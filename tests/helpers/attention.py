"""Inputs for decode attention over a paged pool, and a naive attention to check it against
(shared by tests/test_paged_attention.py and bench/check_paged_attention.py)."""

from __future__ import annotations

import mlx.core as mx


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


def naive(queries, k_pool, v_pool, slots, lengths, scale, window=None) -> mx.array:
    """Row by row, head by head, in float32; a window keeps each row's last positions."""
    batch, heads = queries.shape[:2]
    group = heads // k_pool.shape[1]
    out = []
    for b in range(batch):
        n = lengths[b].item()
        first = max(0, n - window) if window else 0
        idx = slots[b, first:n]
        rows = []
        for h in range(heads):
            k = k_pool[idx, h // group].astype(mx.float32)  # [n, D]
            v = v_pool[idx, h // group].astype(mx.float32)
            q = queries[b, h, 0].astype(mx.float32)
            weights = mx.softmax((k @ q) * scale)
            rows.append(weights @ v)
        out.append(mx.stack(rows)[:, None, :])
    return mx.stack(out)
