"""bench/decode_primitives.py counts a step's primitives from MLX's own graph export."""

from __future__ import annotations

import mlx.core as mx

from bench import decode_primitives as dp


def test_counts_each_primitive_of_an_unevaluated_graph() -> None:
    x = mx.array([1.0, 2.0])
    count = dp.primitives(mx.exp(x) + mx.exp(x * x))
    assert count == {"Exp": 2, "Multiply": 1, "Add": 1}


def test_the_runner_step_and_the_raw_step_are_counted_on_a_preset() -> None:
    raw = dp.primitives(dp.raw_step("tiny-vocab", "float32", 4))
    ours = dp.primitives(dp.runner_step("tiny-vocab", "float32", 4))
    for count in (raw, ours):
        assert count["Matmul"] >= 7  # a layer's seven projections at least
        assert count["ArgReduce"] == 1  # one greedy draw per step
