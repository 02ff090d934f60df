"""service.core.engine.device_memory: kernel constants as template bits or device-held arrays."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from service.core.engine.device_memory import float_bits, resident


@pytest.mark.parametrize("value", [1.0, 0.125, -2.5, 1e-5, 1e-6, 0.08838834764831845])
def test_float_bits_are_the_float32_a_kernel_reads_back(value: float) -> None:
    bits = float_bits(value)
    assert -(2**31) <= bits < 2**31  # an int32 template value
    back = np.array([bits], dtype=np.int32).view(np.float32)[0]
    assert back == np.float32(value)


def test_float_bits_of_one() -> None:
    assert float_bits(1.0) == 0x3F800000


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        (np.array([7], np.int32), None),
        (np.array([[1, 2, 3], [4, 5, 6]], np.int32), None),
        (np.arange(40, dtype=np.int32), None),
        (np.array([0.5, 2.0, 0.25], np.float32), mx.bfloat16),
        (np.array([3.0], np.float32), mx.float16),
    ],
)
def test_resident_holds_the_values_in_their_shape(values: np.ndarray, dtype) -> None:
    held = resident(values, dtype)
    assert held.shape == values.shape
    assert held.dtype == (dtype or mx.array(values).dtype)
    assert np.array_equal(np.array(held.astype(mx.float32)), values.astype(np.float32))
