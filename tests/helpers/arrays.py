"""Bit-for-bit comparison of arrays that says where they differ: a kernel test that fails on a
GPU run should show which rows, columns and values, since the run may not come again soon."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def assert_same(got: mx.array, want: mx.array, context: Any = None) -> None:
    """got equals want element for element (NaN equals nothing), with the same shape."""
    where = f"{context}: " if context is not None else ""
    assert got.shape == want.shape, f"{where}shape {got.shape}, want {want.shape}"
    if mx.array_equal(got, want).item():
        return
    raise AssertionError(where + difference(got, want))


def difference(got: mx.array, want: mx.array) -> str:
    """Where two arrays of one shape differ, as rows of their last axis."""
    g = np.array(got.astype(mx.float32)).reshape(-1, got.shape[-1] if got.ndim else 1)
    w = np.array(want.astype(mx.float32)).reshape(g.shape)
    differ = g != w  # NaN differs from everything, itself included
    rows, cols = np.nonzero(differ)
    gap = np.abs(g - w)[differ]
    worst = int(np.argmax(np.where(np.isnan(gap), np.inf, gap)))
    r, c = int(rows[worst]), int(cols[worst])
    listed = sorted(set(rows.tolist()))
    return (
        f"{len(rows)} of {g.size} elements differ, in rows {listed[:16]}"
        f"{' ...' if len(listed) > 16 else ''} (of {g.shape[0]}), columns {cols.min()}-{cols.max()}"
        f" (of {g.shape[1]}); largest at [{r}, {c}]: {float(g[r, c])!r}, want {float(w[r, c])!r}; "
        f"NaN {int(np.isnan(g).sum())} got, {int(np.isnan(w).sum())} wanted"
    )
