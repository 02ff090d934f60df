"""A decode step's products `x @ w.T` as one custom CUDA kernel on the tensor cores, instead of
MLX's cuBLASLt matmul, for the projections whose weights are small.

MLX builds a cuBLASLt matmul anew for every product it evaluates: descriptors, an algorithm
heuristic, and a stream capture of the launch into the step's CUDA graph (docs/cuda-backend.md).
A custom kernel costs the host a fraction of that. For a small model, a decode step's GPU work
is well under its host work, so a product computed a little slower on the GPU but launched far
more cheaply makes the step faster. A large weight turns that around: the kernel keeps one chunk
of w in flight per block, so it streams a weight at a fraction of cuBLAS's bandwidth, and the
GPU time it loses outgrows the host time it saves. Only weights up to MAX_WEIGHT_BYTES take it
(`install` decides once per layer); larger ones, and prefill passes' rows, keep cuBLAS.

The kernel: a block of 4 warps computes a BM x BN tile of y = x @ w.T. x [M, K] and w [N, K] are
both K-major, as an `nn.Linear` holds its weight. Chunks of KC columns of K are staged in shared
memory (the next chunk's loads are issued before this chunk's products), and each warp
multiplies a 16 x 32 part of the tile with WMMA's 16 x 16 x 16 fragments, accumulating in
float32. The tile then goes through shared memory and out in x's dtype. Rows of the last tile
past M compute zeros and are not written. M is read at run time (x's shape); N and K are
template values, so a model has a kernel per projection shape, not per batch size.

Only half-precision inputs with N and K multiples of the tile take the kernel (there is no
float32 tensor-core product equal to cuBLAS's); everything else, and every platform without
MLX's CUDA backend, takes `x @ w.T`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from mlx import nn

from service.core.engine.paged_attention import kernel_available as available
from service.core.models import projections

BM, BN, KC = 32, 64, 64  # tile rows, tile columns, K columns staged per pass
MAX_ROWS = 256  # decode steps' rows: a prefill pass's thousands take cuBLAS's tuned products
THREADS = 128  # 4 warps: 2 along M (16 rows each) by 2 along N (32 columns each)
# The largest weight that takes the kernel: a small model's projections (and a mid-size one's
# attention), where the step waits for the host; a large model's weights wait for memory.
MAX_WEIGHT_BYTES = 16 << 20

_HEADER = """
#include <mma.h>
"""

_SOURCE = """
    // Tile (mb, nb): rows [mb * BM, +BM) of x and of y, rows [nb * BN, +BN) of w (y's columns).
    using namespace nvcuda;
    constexpr int LD = KC + 8;  // staged row length: 16-byte rows, fewer bank conflicts
    __shared__ __align__(32) T xs[BM * LD];
    __shared__ __align__(32) T ws[BN * LD];
    __shared__ __align__(32) float cs[BM * (BN + 4)];
    const int M = x_shape[0];
    // The row tiles of one column tile are neighbours in launch order, so w's tile is read from
    // memory once and from the cache by the others.
    const int tiles_m = (M + BM - 1) / BM;
    const int mb = blockIdx.x % tiles_m;
    const int nb = blockIdx.x / tiles_m;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int wm = warp / 2;  // the warp's 16 rows
    const int wn = warp % 2;  // the warp's 32 columns
    constexpr int XV = BM * KC / 8 / THREADS;  // 16-byte vectors of x a thread stages a pass
    constexpr int WV = BN * KC / 8 / THREADS;  // ... of w
    const uint4 zero = make_uint4(0, 0, 0, 0);

    uint4 xr[XV];
    uint4 wr[WV];
    // A pass's loads, all issued before any is used (no branch between them): rows of x past M
    // read row 0 again and are zeroed.
    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < XV; ++i) {
            const int v = tid + i * THREADS;
            const int r = v / (KC / 8);
            const int c = (v % (KC / 8)) * 8;
            const int row = mb * BM + r;
            const uint4 u = *reinterpret_cast<const uint4*>(
                x + (size_t)(row < M ? row : 0) * K + k0 + c);
            xr[i] = row < M ? u : zero;
        }
#pragma unroll
        for (int i = 0; i < WV; ++i) {
            const int v = tid + i * THREADS;
            const int r = v / (KC / 8);
            const int c = (v % (KC / 8)) * 8;
            wr[i] = *reinterpret_cast<const uint4*>(w + (size_t)(nb * BN + r) * K + k0 + c);
        }
    };
    auto stage = [&]() {
#pragma unroll
        for (int i = 0; i < XV; ++i) {
            const int v = tid + i * THREADS;
            *reinterpret_cast<uint4*>(xs + (v / (KC / 8)) * LD + (v % (KC / 8)) * 8) = xr[i];
        }
#pragma unroll
        for (int i = 0; i < WV; ++i) {
            const int v = tid + i * THREADS;
            *reinterpret_cast<uint4*>(ws + (v / (KC / 8)) * LD + (v % (KC / 8)) * 8) = wr[i];
        }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
    load(0);
    for (int k0 = 0; k0 < K; k0 += KC) {
        stage();
        __syncthreads();
        if (k0 + KC < K) {
            load(k0 + KC);  // in flight while this pass multiplies
        }
#pragma unroll
        for (int kk = 0; kk < KC; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
            wmma::load_matrix_sync(a, xs + (wm * 16) * LD + kk, LD);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                // w's rows are the product's columns: w [N, K] row-major is B [K, N] col-major.
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
                wmma::load_matrix_sync(bf, ws + (wn * 32 + j * 16) * LD + kk, LD);
                wmma::mma_sync(acc[j], a, bf, acc[j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        wmma::store_matrix_sync(
            cs + (wm * 16) * (BN + 4) + wn * 32 + j * 16, acc[j], BN + 4, wmma::mem_row_major);
    }
    __syncthreads();
    // The tile out, 8 columns a thread at a time, rows past M left alone.
    for (int v = tid; v < BM * BN / 8; v += THREADS) {
        const int r = v / (BN / 8);
        const int c = (v % (BN / 8)) * 8;
        const int row = mb * BM + r;
        if (row < M) {
            __align__(16) T out8[8];  // stored as one 16-byte vector
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                out8[e] = static_cast<T>(cs[r * (BN + 4) + c + e]);
            }
            *reinterpret_cast<uint4*>(y + (size_t)row * N + nb * BN + c) =
                *reinterpret_cast<const uint4*>(out8);
        }
    }
"""


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxserve_decode_gemm",
        input_names=["x", "w"],
        output_names=["y"],
        source=_SOURCE,
        header=_HEADER,
    )


def _tiles(w: mx.array) -> bool:
    """Whether the kernel's tiles cover w [N, K]: half precision, N and K multiples of them."""
    n, k = w.shape
    return w.dtype in (mx.bfloat16, mx.float16) and n % BN == 0 and k % KC == 0


def supported(x: mx.array, w: mx.array) -> bool:
    """Whether `matmul_t(x, w)` takes the kernel: half-precision x and w of one dtype, w's rows
    (N) and columns (K) multiples of the tile, and at most MAX_ROWS rows of x."""
    k = w.shape[1]
    return (
        available()
        and _tiles(w)
        and x.dtype == w.dtype
        and x.shape[-1] == k
        and x.size // k <= MAX_ROWS
    )


def matmul_t(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T for x [..., K] and w [N, K]: the kernel where `supported`, else MLX's matmul."""
    if not supported(x, w):
        return x @ w.T
    n, k = w.shape
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if rows == 0:
        return mx.zeros((*x.shape[:-1], n), dtype=x.dtype)
    blocks = (n // BN) * -(-rows // BM)
    (y,) = _kernel()(
        inputs=[flat, w],
        template=[
            ("T", x.dtype),
            ("N", n),
            ("K", k),
            ("BM", BM),
            ("BN", BN),
            ("KC", KC),
            ("THREADS", THREADS),
        ],
        grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], n)


def takes_kernel(w: mx.array) -> bool:
    """Whether a layer with weight w [N, K] should compute through the kernel: half precision,
    N and K multiples of the tile, and no larger than MAX_WEIGHT_BYTES."""
    return _tiles(w) and w.nbytes <= MAX_WEIGHT_BYTES


class _KernelLinear(nn.Linear):
    """A bias-free `nn.Linear` whose product is `matmul_t`'s."""

    def __call__(self, x: mx.array) -> mx.array:
        return matmul_t(x, self["weight"])


def install(model: nn.Module) -> int:
    """Every layer of the model whose weight `takes_kernel` computes through `matmul_t`: fused
    projection groups without bias or quantization (`projections.groups`), and bias-free
    plain `nn.Linear`s (their class swapped: names, weights and shapes stay). Returns how many
    products: a group counts once."""
    count = 0
    for group in projections.groups(model):
        if (
            not group.quantized
            and "bias" not in group.params
            and takes_kernel(group.params["weight"])
        ):
            group.matmul = matmul_t
            count += 1
    for _, module in model.named_modules():
        if type(module) is nn.Linear and "bias" not in module and takes_kernel(module.weight):
            module.__class__ = _KernelLinear
            count += 1
    return count
