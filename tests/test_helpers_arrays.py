"""The bit-for-bit assertion the GPU kernel tests use: silent on equal arrays, and on unequal
ones it names where they differ (its message runs only when a GPU test fails)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers.arrays import assert_same


def test_equal_arrays_pass_whatever_their_dtype() -> None:
    for dtype in (mx.float32, mx.bfloat16, mx.int32):
        a = mx.arange(12).reshape(3, 4).astype(dtype)
        assert_same(a, mx.array(np.array(a.astype(mx.float32))).astype(dtype))


def test_a_difference_is_named_by_row_column_and_values() -> None:
    want = mx.zeros((2, 3, 8), mx.bfloat16)
    got = np.zeros((2, 3, 8), np.float32)
    got[1, 2, 5] = 0.5  # row 5 of the flattened [6, 8]
    got[0, 1, 0] = 0.25
    with pytest.raises(AssertionError) as raised:
        assert_same(mx.array(got).astype(mx.bfloat16), want, ("part", 1))
    message = str(raised.value)
    assert (
        "('part', 1): 2 of 48 elements differ, in rows [1, 5] (of 6), columns 0-5 (of 8)" in message
    )
    assert "largest at [5, 5]: 0.5, want 0.0" in message


def test_nan_is_a_difference_and_is_counted() -> None:
    want = mx.ones((4,))
    got = mx.array([1.0, float("nan"), 1.0, 1.0])
    with pytest.raises(
        AssertionError,
        match=r"1 of 4 elements differ.*largest at \[0, 1\]: nan.*NaN 1 got, 0 wanted",
    ):
        assert_same(got, want)
    with pytest.raises(AssertionError, match="NaN 1 got, 1 wanted"):
        assert_same(got, got)


def test_shapes_must_match() -> None:
    with pytest.raises(AssertionError, match=r"x: shape \(2, 3\), want \(3, 2\)"):
        assert_same(mx.zeros((2, 3)), mx.zeros((3, 2)), "x")
