"""RMSNorm for the CPU backend as compiled chains.

MLX's CPU `mx.fast.rms_norm` is its fallback: a cast, square, mean, add, rsqrt, two multiplies,
a cast and the broadcasts between them, each a primitive. On the CPU every primitive costs host
work twice, on the thread that queues it and on the stream's thread that runs it, and a small
model's step is mostly that. Traced once by `mx.compile` (shapeless), the same operations are
four primitives: the square, the sum, the width (shapeless: read from the input) and one fused
kernel for the rest. They round the same way (MLX builds its CPU kernels for the baseline
instruction set: no contraction into multiply-adds), so the output is `mx.fast.rms_norm`'s bit
for bit (tests/test_norms.py).

The compiled kernel's inputs broadcast (the sum over each row, the weight over the rows), so MLX
runs it as a strided kernel that indexes every element: past a few thousand elements it costs
more than the fallback's vectorized operations save in primitives
(`bench/cpu_compiled_chains.py`). Larger inputs (a prefill pass, a wide decode batch) take
`rms_norm_wide`: only the per-row part is compiled (one value a row: no broadcast), and the two
multiplies that broadcast the rows' scales and the weight stay MLX's vectorized operations, two
primitives fewer than the fallback. Both round as the fallback does, bit for bit.

`install` swaps every `nn.RMSNorm` of a model (mlx-lm's, in most families; Gemma's own norms add
one to the weight and are left alone) for a `CompiledRMSNorm` holding the same weight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from service.core.models.swap import swap_modules

# Elements from which the vectorized multiplies (rms_norm_wide) cost less than the compiled chain.
COMPILED_MAX_ELEMENTS = 4096


@functools.cache
def _promoted(x_dtype: mx.Dtype, weight_dtype: mx.Dtype) -> mx.Dtype:
    return (mx.zeros((), x_dtype) + mx.zeros((), weight_dtype)).dtype


def _inverse_rms(x: mx.array, eps: mx.array) -> mx.array:
    """The fallback's square, mean, add and rsqrt over each row of float32 `x` (traced into the
    compiled functions below)."""
    return mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)


@functools.cache
def _norm_for(x_dtype: mx.Dtype, weight_dtype: mx.Dtype) -> Callable[..., mx.array]:
    """The fallback's operations in its order, the result in the input's and the weight's
    promoted type, traced once (shapeless) per pair of dtypes."""
    dtype = _promoted(x_dtype, weight_dtype)

    def norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        return (x * _inverse_rms(x, eps)).astype(dtype) * weight.astype(dtype)

    return mx.compile(norm, shapeless=True)


def rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    """`mx.fast.rms_norm(x, weight, eps)` with `eps` a float32 scalar array."""
    return _norm_for(x.dtype, weight.dtype)(x, weight, eps)


# Each row's 1 / rms in float32 (the fallback's cast, square, mean, add and rsqrt), traced once
# (shapeless) per input dtype: its fused kernel's inputs are all one value a row.
_row_scale = mx.compile(lambda x, eps: _inverse_rms(x.astype(mx.float32), eps), shapeless=True)


def rms_norm_wide(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    """`rms_norm` for large inputs: the rows' scales compiled, the two multiplies that broadcast
    them and the weight as MLX's own vectorized operations."""
    dtype = _promoted(x.dtype, weight.dtype)
    scaled = x.astype(mx.float32) * _row_scale(x, eps)
    return scaled.astype(dtype) * weight.astype(dtype)


class CompiledRMSNorm(nn.Module):
    """An `nn.RMSNorm` (same weight, same parameter name) normalizing with `rms_norm`."""

    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self._eps = mx.array(norm.eps, mx.float32)  # underscored: not a parameter

    def __call__(self, x: mx.array) -> mx.array:
        if x.size > COMPILED_MAX_ELEMENTS:
            return rms_norm_wide(x, self["weight"], self._eps)
        return rms_norm(x, self["weight"], self._eps)


def install(model: Any) -> int:
    """Swap every `nn.RMSNorm` of the model for a CompiledRMSNorm; returns how many, having
    built their kernels (`warm`)."""
    dtypes = set()

    def compiled(norm: nn.RMSNorm) -> CompiledRMSNorm:
        dtypes.add(norm.weight.dtype)
        return CompiledRMSNorm(norm)

    swapped = swap_modules(model, lambda child: type(child) is nn.RMSNorm, compiled)
    for dtype in dtypes:
        warm(dtype)
    return swapped


def warm(dtype: mx.Dtype) -> None:
    """Build the kernels a forward's norms use now, narrow and wide: MLX compiles each for the
    CPU on first use (with the system's C++ compiler, about a second on a machine that has not
    cached it yet), one per layout of the inputs (a row or many, 3 or 4 dimensions), and a
    request should not wait for that."""
    eps = mx.array(1e-6, mx.float32)
    weight = mx.ones((8,), dtype)
    for shape in ((1, 1, 8), (2, 3, 8), (1, 1, 1, 8), (2, 3, 2, 8)):
        x = mx.ones(shape, dtype)
        mx.eval(rms_norm(x, weight, eps), rms_norm_wide(x, weight, eps))
