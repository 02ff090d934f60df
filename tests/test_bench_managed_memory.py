"""bench/managed_memory.py's summary of CUPTI kernel records (the benchmark itself needs CUDA)."""

from __future__ import annotations

import pytest

from bench.managed_memory import kernel_means


def test_kernel_means_average_each_name() -> None:
    records = [(0.0, 2.0, "a"), (5.0, 9.0, "a"), (3.0, 4.0, "b")]
    means = kernel_means(records)
    assert means["a"] == {"mean_us": pytest.approx(3.0), "count": 2}
    assert means["b"] == {"mean_us": pytest.approx(1.0), "count": 1}


def test_kernel_means_of_nothing() -> None:
    assert kernel_means([]) == {}
