"""bench/cuda_timeline.py's reading of a profiler trace: which events are GPU kernels, and how
busy the GPU was over their span (overlapping kernels counted once)."""

from __future__ import annotations

import pytest

from bench.cuda_timeline import kernel_intervals, summarize


def test_only_kernel_events_are_read_in_start_order() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "b", "ts": 30.0, "dur": 5.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 2.0},
            {"ph": "X", "cat": "kernel", "name": "a", "ts": 10.0, "dur": 10.0},
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 12.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 50.0, "dur": 1.0},
        ]
    }
    assert kernel_intervals(trace) == [(10.0, 20.0, "a"), (30.0, 35.0, "b")]
    assert kernel_intervals({}) == []


def test_busy_time_is_the_union_of_the_kernels_intervals() -> None:
    # 0-10 and 5-15 overlap (15 µs busy), 12-14 lies inside them, 20-30 after a gap:
    # 25 µs busy over a 30 µs span.
    kernels = [(0.0, 10.0, "mm"), (5.0, 15.0, "mm"), (12.0, 14.0, "rope"), (20.0, 30.0, "attn")]
    got = summarize(kernels, steps=2)
    assert got["kernels"] == 4 and got["kernels_per_step"] == 2
    assert got["span_ms"] == pytest.approx(0.030)
    assert got["busy_ms"] == pytest.approx(0.025)
    assert got["busy_share"] == pytest.approx(25 / 30)
    assert got["busy_ms_per_step"] == pytest.approx(0.0125)
    assert [(k["name"], k["count"]) for k in got["top"]] == [("mm", 2), ("attn", 1), ("rope", 1)]
    assert got["top"][0]["total_ms"] == pytest.approx(0.020)
    assert summarize([], steps=3) == {"kernels": 0}
