"""Per-row LoRA updates on CUDA in two kernels: `y + scale * ((x @ A[s]) @ B[s])` for each row's
own adapter slot s, without a per-row product and without touching other adapters' weights.

MLX's CUDA backend pays host work per primitive, and a decode step is bound by it: the MLX-op
forms of a mixed batch's update (a gathered product per row, or every row times the whole stack
with the other adapters masked out) add five to ten primitives to every adapted layer, more than
the layer itself. Here each adapted layer adds two: `shrink` (z = x @ A[s], a warp per output,
[tokens, r] in float32) and `expand_add` (y + scale * z @ B[s], cast as mlx-lm casts it). The
reductions run in another order than a matmul's, so the numbers equal mlx-lm's to float
tolerance. Elsewhere the same computation runs from MLX ops (`reference_*`): what the CPU tests
exercise, and what the GPU tests hold the kernels to.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

# The same condition as the decode attention kernel's: MLX's CUDA backend, the GPU the default.
from service.core.engine.paged_attention import kernel_available as available

SHRINK_WARPS = 8  # warps per token in `shrink`: each takes every SHRINK_WARPS-th rank column

_SHRINK = """
    // One block per token; warp w computes columns w, w + WARPS, ... of z[t] = x[t] @ A[s].
    // A arrives transposed, [S, R, IN], so a warp's lanes read consecutive inputs.
    const int t = blockIdx.x;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const size_t s = (size_t)idx[t];
    const TX* xr = x + (size_t)t * IN;
    for (int k = warp; k < R; k += WARPS) {
        const TA* ar = a_t + (s * R + k) * IN;
        float acc = 0.0f;
        for (int i = lane; i < IN; i += 32) {
            acc += static_cast<float>(xr[i]) * static_cast<float>(ar[i]);
        }
        for (int offset = 16; offset > 0; offset /= 2) {
            acc += __shfl_xor_sync(0xffffffff, acc, offset);
        }
        if (lane == 0) {
            z[(size_t)t * R + k] = acc;
        }
    }
"""

_EXPAND_ADD = """
    // One thread per output element: y[t, o] + (scale[t] * sum_k z[t, k] * B[s, k, o]), the
    // update cast to y's dtype before the add (mlx-lm's `y + (scale * z).astype(x.dtype)`).
    const size_t n = (size_t)y_shape[0] * OUT;
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) {
        return;
    }
    const size_t t = e / OUT;
    const size_t o = e % OUT;
    const size_t s = (size_t)idx[t];
    const TB* bs = b + s * R * OUT + o;
    const float* zt = z + t * R;
    float acc = 0.0f;
    for (int k = 0; k < R; ++k) {
        acc += zt[k] * static_cast<float>(bs[(size_t)k * OUT]);
    }
    const TY d = static_cast<TY>(scale[t] * acc);
    out[e] = static_cast<TY>(static_cast<float>(y[e]) + static_cast<float>(d));
"""


@cache
def _shrink() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxserve_lora_shrink",
        input_names=["x", "a_t", "idx"],
        output_names=["z"],
        source=_SHRINK,
    )


@cache
def _expand_add() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxserve_lora_expand_add",
        input_names=["y", "z", "b", "idx", "scale"],
        output_names=["out"],
        source=_EXPAND_ADD,
    )


def shrink(x: mx.array, a_t: mx.array, idx: mx.array) -> mx.array:
    """z [T, r] float32: each token's input x [T, in] times its slot's A (a_t [S, r, in],
    idx [T] int32)."""
    if not available():
        return reference_shrink(x, a_t, idx)
    tokens, width = x.shape
    rank = a_t.shape[1]
    warps = min(SHRINK_WARPS, rank)
    (z,) = _shrink()(
        inputs=[x, a_t, idx],
        template=[
            ("TX", x.dtype),
            ("TA", a_t.dtype),
            ("IN", width),
            ("R", rank),
            ("WARPS", warps),
        ],
        grid=(tokens * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(tokens, rank)],
        output_dtypes=[mx.float32],
    )
    return z


def expand_add(y: mx.array, z: mx.array, b: mx.array, idx: mx.array, scale: mx.array) -> mx.array:
    """y [T, out] plus each token's update scale[t] * z[t] @ B[idx[t]] (b [S, r, out]), in y's
    dtype."""
    if not available():
        return reference_expand_add(y, z, b, idx, scale)
    tokens, width = y.shape
    size = tokens * width
    (out,) = _expand_add()(
        inputs=[y, z, b, idx, scale],
        template=[("TY", y.dtype), ("TB", b.dtype), ("R", b.shape[1]), ("OUT", width)],
        grid=(size, 1, 1),
        threadgroup=(min(256, size), 1, 1),
        output_shapes=[y.shape],
        output_dtypes=[y.dtype],
    )
    return out


def reference_shrink(x: mx.array, a_t: mx.array, idx: mx.array) -> mx.array:
    """`shrink` from MLX ops: float32 products of each token with its own slot's A."""
    a = a_t[idx].swapaxes(1, 2).astype(mx.float32)  # [T, in, r]
    return (x.astype(mx.float32)[:, None, :] @ a)[:, 0]


def reference_expand_add(
    y: mx.array, z: mx.array, b: mx.array, idx: mx.array, scale: mx.array
) -> mx.array:
    """`expand_add` from MLX ops."""
    d = (z[:, None, :] @ b[idx].astype(mx.float32))[:, 0]
    return y + (scale[:, None] * d).astype(y.dtype)
