"""A decoder layer's residual add and the RMSNorm after it, as one kernel on CUDA.

mlx-lm's llama, qwen2 and qwen3 layers compute

    r = attention(input_norm(x)); h = x + r; r = mlp(post_norm(h)); out = h + r

and the next layer starts with input_norm(out): every add is followed by a norm of its sum. On
MLX's CUDA backend each is a kernel, and every kernel costs the host its share of a step
(docs/cuda-backend.md). `add_rms_norm` makes the sum and its norm in one: two kernels a layer
fewer, the add inside a layer and the one that ends it.

`FusedNormBlock` (the layer's class, swapped by `install`: names and weights stay) adds and
normalizes with it after attention. The sum that ends the layer it returns as mlx-lm does
(`h + r`), and keeps (h, r) for the next layer: when that layer's input is that very array, it
computes the sum and its norm in one kernel and never reads the returned one, whose add MLX then
does not run (an unread array is not evaluated). The last layer's sum is what the model's final
norm reads, so it stays.

The sum is rounded to the input dtype before the norm reads it and the norm is MLX's RMSNorm
arithmetic (float32 sum of squares, the product rounded, then times the weight in the dtype), so
the results equal mlx-lm's to the order of the sum's reduction. Elsewhere than CUDA the same two
MLX ops run (what the CPU tests exercise).
"""

from __future__ import annotations

import threading
import weakref
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from service.core.engine.device_memory import float_bits
from service.core.engine.paged_attention import kernel_available as available

THREADS = 128
MAX_PER_THREAD = 32  # hidden sizes up to THREADS * this take the kernel (8B's 4096 do)
_FAMILIES = ("llama", "qwen2", "qwen3")  # whose TransformerBlock is the pattern above

_SOURCE = """
    // One block per row: h = x + r (rounded to T), then y = w * T(h * rsqrt(mean(h^2) + eps)).
    constexpr int PER = (D + THREADS - 1) / THREADS;
    const size_t row = blockIdx.x;
    const int tid = threadIdx.x;
    float hv[PER];
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = tid + j * THREADS;
        if (i < D) {
            const T sum = static_cast<T>(
                static_cast<float>(x[row * D + i]) + static_cast<float>(r[row * D + i]));
            h[row * D + i] = sum;
            hv[j] = static_cast<float>(sum);
            squares += hv[j] * hv[j];
        }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        squares += __shfl_xor_sync(0xffffffff, squares, offset);
    }
    __shared__ float warp_sums[THREADS / 32];
    if (tid % 32 == 0) {
        warp_sums[tid / 32] = squares;
    }
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < THREADS / 32; ++k) {
        total += warp_sums[k];
    }
    const float normalizer = rsqrt(total / D + __int_as_float(EPS_BITS));
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = tid + j * THREADS;
        if (i < D) {
            y[row * D + i] = w[i] * static_cast<T>(hv[j] * normalizer);
        }
    }
"""


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxserve_add_rms_norm",
        input_names=["x", "r", "w"],
        output_names=["h", "y"],
        source=_SOURCE,
    )


def supported(x: mx.array, r: mx.array, weight: mx.array) -> bool:
    """Whether `add_rms_norm` takes the kernel: one dtype for x, r and the weight, and a hidden
    size the kernel's threads hold."""
    width = x.shape[-1]
    return (
        available()
        and x.dtype == r.dtype == weight.dtype
        and x.shape == r.shape
        and weight.shape == (width,)
        and width <= THREADS * MAX_PER_THREAD
    )


def add_rms_norm(
    x: mx.array, r: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """(h, rms_norm(h)) for h = x + r: one kernel where `supported`, else MLX's two ops."""
    if not supported(x, r, weight):
        h = x + r
        return h, mx.fast.rms_norm(h, weight, eps)
    width = x.shape[-1]
    rows = x.size // width
    if rows == 0:
        return x + r, mx.zeros_like(x)
    h, y = _kernel()(
        inputs=[x, r, weight],
        # eps is a template value, not an array: see device_memory.
        template=[
            ("T", x.dtype),
            ("D", width),
            ("THREADS", THREADS),
            ("EPS_BITS", float_bits(eps)),
        ],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, y


class _Sum:
    """The last layer's returned sum on one thread: a weak reference to it, and the two arrays
    it adds (kept only while the sum itself is alive, so a forward's activations are not)."""

    def __init__(self) -> None:
        self.held: tuple[weakref.ref[mx.array], mx.array, mx.array] | None = None

    def keep(self, out: mx.array, h: mx.array, r: mx.array) -> None:
        self.held = (weakref.ref(out, self._drop), h, r)

    def parts_of(self, x: mx.array) -> tuple[mx.array, mx.array] | None:
        """(h, r) when x is the kept sum h + r."""
        held = self.held
        if held is None or held[0]() is not x:
            return None
        return held[1], held[2]

    def _drop(self, ref: weakref.ref[mx.array]) -> None:
        if self.held is not None and self.held[0] is ref:
            self.held = None


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.sum = _Sum()


_PER_THREAD = _PerThread()


class FusedNormBlock(nn.Module):
    """mlx-lm's llama/qwen2/qwen3 `TransformerBlock`, its adds fused with the norms after them
    (the class of such a layer is swapped to this one; see the module's docstring)."""

    input_layernorm: nn.RMSNorm
    post_attention_layernorm: nn.RMSNorm
    self_attn: nn.Module
    mlp: nn.Module

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        kept = _PER_THREAD.sum
        parts = kept.parts_of(x)
        if parts is not None:
            # x is the last layer's h + r, which this call computes with its norm instead.
            norm = self.input_layernorm
            x, normed = add_rms_norm(*parts, norm.weight, norm.eps)
        else:
            normed = self.input_layernorm(x)
        r = self.self_attn(normed, mask, cache)
        post = self.post_attention_layernorm
        h, normed = add_rms_norm(x, r, post.weight, post.eps)
        r = self.mlp(normed)
        out = h + r
        kept.keep(out, h, r)
        return out


def install(model: Any) -> int:
    """Swap the class of every llama/qwen2/qwen3 decoder layer whose norms are plain RMSNorms
    for its `FusedNormBlock` subclass; returns how many."""
    swapped = 0
    for module in model.modules():
        if _is_plain_block(module):
            module.__class__ = _fused(type(module))
            swapped += 1
    return swapped


@cache
def _fused(kind: type) -> type:
    return type(f"Fused{kind.__name__}", (FusedNormBlock, kind), {})


def _is_plain_block(module: Any) -> bool:
    kind = type(module)
    family = kind.__module__.rsplit(".", 1)[-1]
    if kind.__name__ != "TransformerBlock" or family not in _FAMILIES:
        return False
    norms = [module.get("input_layernorm"), module.get("post_attention_layernorm")]
    return all(type(n) is nn.RMSNorm for n in norms)
