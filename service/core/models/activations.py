"""SwiGLU for the CPU backend, with an exp built from multiply-adds.

MLX's CPU `exp` (and so `sigmoid`/`silu`) costs an order of magnitude more per element than a
multiply, enough to make the MLP's `silu(gate) * up` a large share of a float32 forward. Here
exp is range-reduced (x = n·ln2 + f, |f| ≤ ln2/2), e^f is a degree-7 polynomial and 2^n is
built in the float's exponent bits: multiply-adds, within a few float32 ulps of MLX's silu
(tested), fused by `mx.compile` into a few primitives.
`install` swaps the MLP of mlx-lm's llama-family layers for one that uses it; the weights and
their names do not change.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from service.core.models.swap import swap_modules

_LOG2E = 1.4426950408889634
# ln 2 split so that n * _LN2_HI is exact for the |n| <= 128 used here (Cody–Waite).
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
_TAYLOR = [1.0 / math.factorial(k) for k in range(8)]  # e^f, |f| <= 0.35: error < 1e-8
_SWIGLU_MODULES = ("llama", "qwen2", "qwen3", "mistral")
# Tokens in a forward from which fast_swiglu beats mlx-lm's swiglu (bench/swiglu.py).
FAST_MIN_ROWS = 2


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """e^x as (e^f, the int32 bits of 2^n): the product of the first and the second viewed as
    float32. Inputs are clamped to [-87, 88] (no inf/0)."""
    x = mx.clip(x, -87.0, 88.0)
    # n = floor(x·log2e + 0.5) as the truncation of a positive sum (offset by 128): in MLX's
    # compiled CPU kernels `floor` costs more than the whole polynomial, a conversion little.
    biased = (x * _LOG2E + 128.5).astype(mx.int32)  # n + 128
    n = (biased - 128).astype(mx.float32)
    f = (x - n * _LN2_HI) - n * _LN2_LO
    p = _TAYLOR[7]
    for c in reversed(_TAYLOR[:7]):
        p = p * f + c
    return p, mx.left_shift(biased - 1, 23)  # 2^n: exponent bits n + 127


# Compiled, the chain is a few fused primitives whatever the shape (MLX splits long chains), not
# one per op. The bit view between the parts cannot be traced shapeless, so it stays out.
_exp_of = mx.compile(_exp_parts, shapeless=True)
_exp_of_negated = mx.compile(lambda x: _exp_parts(-x), shapeless=True)
_swiglu_from = mx.compile(lambda gate, x, p, two_n: gate / (1.0 + p * two_n) * x, shapeless=True)


def fast_exp(x: mx.array) -> mx.array:
    """e^x for float32 arrays, to a few ulps; inputs are clamped to [-87, 88] (no inf/0)."""
    p, bits = _exp_of(x)
    return p * bits.view(mx.float32)


def fast_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x with the exp of fast_exp."""
    p, bits = _exp_of_negated(gate)
    return _swiglu_from(gate, x, p, bits.view(mx.float32))


class FastSwiGLUMLP(nn.Module):
    """An mlx-lm llama-family MLP (same linears, same parameter names) using fast_swiglu."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        # For a few rows its fused kernels cost more in dispatch than MLX's exp costs in math.
        if gate.size < FAST_MIN_ROWS * gate.shape[-1]:
            return self.down_proj(swiglu(gate, up))
        return self.down_proj(fast_swiglu(gate, up))


def install(model: Any) -> int:
    """Give each llama-family float32 layer a FastSwiGLUMLP; returns how many were swapped
    (0 for other architectures and dtypes, which keep mlx-lm's MLP)."""
    swapped = swap_modules(model, _is_swiglu_mlp, FastSwiGLUMLP)
    if swapped:
        warm()
    return swapped


def warm() -> None:
    """Build the MLPs' fused kernels now, fast_swiglu's and mlx-lm's compiled swiglu (fewer
    rows than FAST_MIN_ROWS): MLX compiles them for the CPU on first use (with the system's
    C++ compiler, seconds on a machine that has not cached them yet), and a request should not
    wait for that. Any contiguous float32 input builds the kernels every shape uses."""
    gate = mx.zeros((1, 2, 8), dtype=mx.float32)
    mx.eval(fast_swiglu(gate, gate), swiglu(gate, gate))


def _is_swiglu_mlp(mlp: Any) -> bool:
    module = type(mlp).__module__.rsplit(".", 1)[-1]
    if type(mlp).__name__ != "MLP" or module not in _SWIGLU_MODULES:
        return False
    gate = getattr(mlp, "gate_proj", None)
    return type(gate) is nn.Linear and gate.weight.dtype == mx.float32
