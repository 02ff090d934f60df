"""A decode step's products `x @ w.T` as one custom CUDA kernel on the tensor cores, instead of
MLX's cuBLASLt matmul, for the projections whose weights are small.

MLX builds a cuBLASLt matmul anew for every product it evaluates: descriptors, an algorithm
heuristic, and a stream capture of the launch into the step's CUDA graph (docs/cuda-backend.md).
A custom kernel costs the host a fraction of that. For a small model, a decode step's GPU work
is well under its host work, so a product computed a little slower on the GPU but launched far
more cheaply makes the step faster. A large weight is another matter: its product waits for
memory, and there the kernel must stream w as fast as cuBLAS does or lose more GPU time than it
saves host time. Only weights up to MAX_WEIGHT_BYTES take it (`install` decides once per layer);
larger ones, and prefill passes' rows, keep cuBLAS.

The kernel: a block of 4 warps computes a BM x BN tile of y = x @ w.T. x [M, K] and w [N, K] are
both K-major, as an `nn.Linear` holds its weight. Chunks of KC columns of K are copied into
shared memory asynchronously (cp.async), STAGES - 1 chunks ahead of the products: a decode
step's grid has too few blocks to keep enough of w in flight otherwise. Each warp
multiplies a 16 x 32 part of the tile with WMMA's 16 x 16 x 16 fragments, accumulating in
float32. The tile then goes through shared memory and out in x's dtype. Rows of the last tile
past M compute zeros and are not written. M is read at run time (x's shape); N and K are
template values, so a model has a kernel per projection shape, not per batch size.

A SwiGLU MLP whose fused gate/up weight takes the kernel gets its activation from it too
(`swiglu_t`, GATED): a tile stages the gate rows and the up rows of the same outputs, and writes
silu(gate) * up, one kernel fewer a layer.

Only half-precision inputs with N and K multiples of the tile take the kernel (there is no
float32 tensor-core product equal to cuBLAS's); everything else, and every platform without
MLX's CUDA backend, takes `x @ w.T`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.activations import swiglu

from service.core.engine.kernel_source import cuda_kernel
from service.core.engine.paged_attention import kernel_available as available
from service.core.models import projections

BM, BN, KC = 32, 64, 64  # tile rows, tile columns, K columns staged per chunk
# Chunks of x and w in flight per block: a block streams w at the rate of STAGES - 1 chunks per
# memory latency, and a decode step's grid is too small to hide that latency with more blocks.
STAGES = 3
MAX_ROWS = 256  # decode steps' rows: a prefill pass's thousands take cuBLAS's tuned products
THREADS = 128  # 4 warps: 2 along M (16 rows each) by 2 along N (32 columns each)
# The largest weight that takes the kernel: a small model's projections (and a mid-size one's
# attention), where the step waits for the host; a large model's weights wait for memory.
MAX_WEIGHT_BYTES = 16 << 20

_HEADER = """
#include <mma.h>

// A 16-byte copy from global to shared memory that does not hold up the thread (cp.async,
// sm_80+); `bytes` 0 fills the 16 bytes with zeros instead of reading.
__device__ __forceinline__ void mlxserve_copy16(void* shared, const void* global, int bytes) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" ::"r"(to), "l"(global),
                 "r"(bytes) : "memory");
}
__device__ __forceinline__ void mlxserve_copies_commit() {
    asm volatile("cp.async.commit_group;\\n" ::: "memory");
}
// Wait until at most `Pending` committed groups of this thread's copies are still in flight.
template <int Pending>
__device__ __forceinline__ void mlxserve_copies_wait() {
    // The "memory" clobbers keep the compiler from moving shared-memory reads across the wait.
    asm volatile("cp.async.wait_group %0;\\n" ::"n"(Pending) : "memory");
}
"""

_SOURCE = """
    // Tile (mb, nb): rows [mb * BM, +BM) of x and of y, rows [nb * BN, +BN) of w (y's columns).
    using namespace nvcuda;
    constexpr int LD = KC + 8;  // staged row length: 16-byte rows, fewer bank conflicts
    constexpr int STAGE = (BM + BN) * LD;  // one chunk: x's rows, then w's
    // STAGES chunks in flight; after the last product the same memory holds the float tile.
    static_assert(BM * (BN + 4) * 4 <= STAGES * STAGE * 2, "the tile fits the stages");
    __shared__ __align__(128) T stages[STAGES * STAGE];
    float* cs = reinterpret_cast<float*>(stages);
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
    constexpr int XV = BM * KC / 8 / THREADS;  // 16-byte vectors of x a thread copies a chunk
    constexpr int WV = BN * KC / 8 / THREADS;  // ... of w
    constexpr int CHUNKS = K / KC;
    // The tile's BN staged rows of w. GATED (a SwiGLU MLP's gate/up weight, [2 * N, K]): the
    // first BN / 2 are gate rows, the others the up rows of the same outputs.
    auto w_row = [&](int r) -> int {
        if (GATED) {
            return r < BN / 2 ? nb * (BN / 2) + r : N + nb * (BN / 2) + r - BN / 2;
        }
        return nb * BN + r;
    };
    // Staged row of a warp's j-th 16 columns: ungated, the warp's 32 columns; GATED, its 16
    // gate columns (j = 0) and their up columns (j = 1).
    auto frag_row = [&](int j) -> int {
        return GATED ? j * (BN / 2) + wn * 16 : wn * 32 + j * 16;
    };

    // Chunk `chunk`'s copies into stage `chunk % STAGES`, committed as one group (an empty
    // group past the last chunk, so that every iteration waits for the same count). Rows of x
    // past M read nothing and stage zeros.
    auto issue = [&](int chunk) {
        if (chunk < CHUNKS) {
            T* xs = stages + (chunk % STAGES) * STAGE;
            T* ws = xs + BM * LD;
            const int k0 = chunk * KC;
#pragma unroll
            for (int i = 0; i < XV; ++i) {
                const int v = tid + i * THREADS;
                const int r = v / (KC / 8);
                const int c = (v % (KC / 8)) * 8;
                const int row = mb * BM + r;
                mlxserve_copy16(xs + r * LD + c, x + (size_t)(row < M ? row : 0) * K + k0 + c,
                                row < M ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < WV; ++i) {
                const int v = tid + i * THREADS;
                const int r = v / (KC / 8);
                const int c = (v % (KC / 8)) * 8;
                mlxserve_copy16(ws + r * LD + c, w + (size_t)w_row(r) * K + k0 + c, 16);
            }
        }
        mlxserve_copies_commit();
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
#pragma unroll
    for (int chunk = 0; chunk < STAGES - 1; ++chunk) {
        issue(chunk);
    }
    for (int chunk = 0; chunk < CHUNKS; ++chunk) {
        mlxserve_copies_wait<STAGES - 2>();  // this thread's copies of `chunk` have landed
        // Everyone's have, and everyone is done with the stage the next issue overwrites
        // (chunk - 1's).
        __syncthreads();
        issue(chunk + STAGES - 1);
        const T* xs = stages + (chunk % STAGES) * STAGE;
        const T* ws = xs + BM * LD;
#pragma unroll
        for (int kk = 0; kk < KC; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
            wmma::load_matrix_sync(a, xs + (wm * 16) * LD + kk, LD);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                // w's rows are the product's columns: w [N, K] row-major is B [K, N] col-major.
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
                wmma::load_matrix_sync(bf, ws + frag_row(j) * LD + kk, LD);
                wmma::mma_sync(acc[j], a, bf, acc[j]);
            }
        }
    }
    mlxserve_copies_wait<0>();  // only empty groups are left; the stages become the tile
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        wmma::store_matrix_sync(
            cs + (wm * 16) * (BN + 4) + frag_row(j), acc[j], BN + 4, wmma::mem_row_major);
    }
    __syncthreads();
    // The tile out, 8 columns a thread at a time, rows past M left alone. GATED: the tile's
    // columns are BN / 2 gates then their ups, and out goes silu(gate) * up with the roundings
    // of mlx-lm's swiglu (each product in T, then each op of silu(g) * u in T).
    constexpr int OUT = GATED ? BN / 2 : BN;
    for (int v = tid; v < BM * OUT / 8; v += THREADS) {
        const int r = v / (OUT / 8);
        const int c = (v % (OUT / 8)) * 8;
        const int row = mb * BM + r;
        if (row < M) {
            __align__(16) T out8[8];  // stored as one 16-byte vector
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const T value = static_cast<T>(cs[r * (BN + 4) + c + e]);
                if (GATED) {
                    const float g = static_cast<float>(value);
                    const float u = static_cast<float>(
                        static_cast<T>(cs[r * (BN + 4) + BN / 2 + c + e]));
                    // MLX's Sigmoid on T: y = 1 / (1 + exp|g|) rounded to T (its exp of a
                    // T rounded too), then y or 1 - y by the sign, rounded again.
                    const T exp_abs = static_cast<T>(expf(fabsf(g)));
                    const T y = static_cast<T>(1.0f / (1.0f + static_cast<float>(exp_abs)));
                    const T sig = g < 0.0f ? y : static_cast<T>(1.0f - static_cast<float>(y));
                    const T silu = static_cast<T>(g * static_cast<float>(sig));
                    out8[e] = static_cast<T>(static_cast<float>(silu) * u);
                } else {
                    out8[e] = value;
                }
            }
            *reinterpret_cast<uint4*>(y + (size_t)row * N + nb * OUT + c) =
                *reinterpret_cast<const uint4*>(out8);
        }
    }
"""


@cache
def _kernel() -> Any:
    return cuda_kernel(
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
    return _launch(x, w, w.shape[0], gated=False)


def swiglu_t(x: mx.array, w: mx.array) -> mx.array:
    """mlx-lm's `swiglu(x @ gate.T, x @ up.T)` for w [2 * I, K], the gate's rows then the up's
    (a fused gate/up group's weight): one kernel where `supported`, else MLX's product and
    mlx-lm's swiglu. Returns [..., I]."""
    inter = w.shape[0] // 2
    if not supported(x, w) or inter % (BN // 2):
        gate, up = mx.split(x @ w.T, [inter], axis=-1)
        return swiglu(gate, up)
    return _launch(x, w, inter, gated=True)


def _launch(x: mx.array, w: mx.array, width: int, gated: bool) -> mx.array:
    """The kernel over x's rows flattened, `width` outputs a row (a tile holds BN of them, or
    BN / 2 gated), shaped as x."""
    k = w.shape[1]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if rows == 0:
        return mx.zeros((*x.shape[:-1], width), dtype=x.dtype)
    blocks = (width // (BN // 2 if gated else BN)) * -(-rows // BM)
    (y,) = _kernel()(
        inputs=[flat, w],
        template=[
            ("T", x.dtype),
            ("N", width),
            ("K", k),
            ("BM", BM),
            ("BN", BN),
            ("KC", KC),
            ("STAGES", STAGES),
            ("THREADS", THREADS),
            ("GATED", int(gated)),
        ],
        grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, width)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], width)


def takes_kernel(w: mx.array) -> bool:
    """Whether a layer with weight w [N, K] should compute through the kernel: half precision,
    N and K multiples of the tile, and no larger than MAX_WEIGHT_BYTES."""
    return _tiles(w) and w.nbytes <= MAX_WEIGHT_BYTES


class _KernelLinear(nn.Linear):
    """A bias-free `nn.Linear` whose product is `matmul_t`'s."""

    def __call__(self, x: mx.array) -> mx.array:
        return matmul_t(x, self["weight"])


class KernelSwiGLU(nn.Module):
    """mlx-lm's llama/qwen2/qwen3 MLP whose fused gate/up group takes the kernel: the gate/up
    product and `swiglu` are one kernel (`swiglu_t`) while the group computes for both members
    as one (not when adapters wrap them: their updates come before the activation)."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def __call__(self, x: mx.array) -> mx.array:
        group = projections.whole_group([self.gate_proj, self.up_proj])
        if group is None:
            return super().__call__(x)  # type: ignore[misc]
        return self.down_proj(swiglu_t(x, group.params["weight"]))


_SWIGLU_FAMILIES = ("llama", "qwen2", "qwen3")  # whose MLP is down(swiglu(gate(x), up(x)))


def install(model: nn.Module) -> int:
    """Every layer of the model whose weight `takes_kernel` computes through `matmul_t`: fused
    projection groups without bias or quantization (`projections.groups`), and bias-free
    plain `nn.Linear`s (their class swapped: names, weights and shapes stay). Returns how many
    products: a group counts once. The SwiGLU MLPs whose gate/up group takes it compute their
    activation in the same kernel (`KernelSwiGLU`)."""
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
        elif _is_kernel_swiglu_mlp(module):
            module.__class__ = _swiglu_class(type(module))
    return count


def _is_kernel_swiglu_mlp(module: nn.Module) -> bool:
    kind = type(module)
    if kind.__name__ != "MLP" or kind.__module__.rsplit(".", 1)[-1] not in _SWIGLU_FAMILIES:
        return False
    group = projections.whole_group([module.get("gate_proj"), module.get("up_proj")])
    return group is not None and group.matmul is matmul_t


@cache
def _swiglu_class(kind: type) -> type:
    return type(f"Kernel{kind.__name__}", (KernelSwiGLU, kind), {})
