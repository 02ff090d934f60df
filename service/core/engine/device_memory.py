"""Constants our CUDA kernels read, kept out of unified memory.

MLX's CUDA allocator puts every array made from host data, and every array of 8 bytes or less,
in CUDA managed memory; only arrays that ops make on a stream go to device memory. The small
arrays share one pool of pages, and the host keeps writing it: the scalar operands MLX makes for
Python numbers land there. A kernel that reads a constant from such a page waits for the page
(read across the bus, or migrated back), which can cost more than the kernel's own work. So a
kernel takes its constants as template values (a float as its bits: `float_bits`) or, where one
would compile a kernel per value, as an array copied into device memory once (`resident`).
docs/cuda-backend.md explains it; `bench/managed_memory.py` measures it.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

_MIN_ELEMENTS = 16  # past the 8 bytes of MLX's scalar pool, whatever the dtype


@functools.cache  # a kernel call asks for its constants' bits every time; they are few
def float_bits(value: float) -> int:
    """`value` rounded to float32, as the int32 of its bits (a kernel's template value, which
    the kernel reads back with `__int_as_float`)."""
    return int(np.array([value], dtype=np.float32).view(np.int32)[0])


def resident(values: np.ndarray, dtype: mx.Dtype | None = None) -> mx.array:
    """`values` (as `dtype`, default theirs) as an MLX array held in device memory on CUDA
    (elsewhere, as made from the host): a copy made on the GPU, padded past the scalar pool."""
    host = np.ascontiguousarray(values)
    if not mx.cuda.is_available():
        made = mx.array(host)
        return made if dtype is None else made.astype(dtype)
    flat = host.reshape(-1)
    padded = np.zeros(max(flat.size, _MIN_ELEMENTS), dtype=flat.dtype)
    padded[: flat.size] = flat
    source = mx.array(padded)
    # `source` stays referenced until the copy is evaluated, so the add cannot reuse its buffer.
    copy = (source + mx.zeros_like(source)).astype(dtype or source.dtype)
    mx.eval(copy)
    return copy[: flat.size].reshape(host.shape)
