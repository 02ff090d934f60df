"""Per-row LoRA updates on CUDA: `y + scale * ((x @ A[s]) @ B[s])` for each row's own adapter
slot s, without a per-row product and without touching other adapters' weights.

MLX's CUDA backend pays host work per primitive, and a decode step is bound by it: the MLX-op
forms of a mixed batch's update (a gathered product per row, or every row times the whole stack
with the other adapters masked out) add five to ten primitives to every adapted layer, more than
the layer itself. Here an update is one kernel, `fused_add`, and one call serves several modules
that read the same input (an attention's q, k and v; an MLP's gate and up: service.core.models.
lora groups them), each with its own stacks, slots and output.

A tile of up to TILE tokens of one slot s of one module is taken by `blocks(out)` blocks, each
writing up to BLOCK_OUTPUTS of the module's outputs. They split z = x[t] @ A[s] for the tile's
tokens between them, each summing a slice of the input (float32) and writing it out (after the
launch's counts, in the same array); they meet at the tile's count (`Counts`: docs/lora.md says
how, and why not through a thread block cluster), and each adds the slices in slice order and
writes its share of the outputs, y + scale * z @ B[s] cast as mlx-lm casts it. So each element of A
and B is read once for the tile. The tiles are found in the kernel from the tokens' slots (a token
leads a tile when the tokens of its slot before it are a multiple of TILE); the grid holds as many
as there can be (`tiles`) and the blocks past the last return. A token's sums run over the same
threads in the same order whatever its tile holds, so its numbers do not depend on the batch. The
shares and slices depend on the module's shape only, not on the number of tokens: a template value
that changed with the tokens would compile a kernel variant at the first step of each new size, a
stall in the middle of serving.

Under tensor parallel a sharded-to-all layer sums z over the group between the two products, so
it takes two kernels: `shrink` (z = x @ A[s], [tokens, r] float32) and `expand_add`.

The reductions run in another order than a matmul's, so the numbers equal mlx-lm's to float
tolerance. Elsewhere the same computation runs from MLX ops (`reference_*`): what the CPU tests
exercise, and what the GPU tests hold the kernels to.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from service.core.engine.device_memory import resident
from service.core.engine.kernel_source import cuda_kernel

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
    return cuda_kernel(
        name="mlxserve_lora_shrink",
        input_names=["x", "a_t", "idx"],
        output_names=["z"],
        source=_SHRINK,
    )


@cache
def _expand_add() -> Any:
    return cuda_kernel(
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


FUSED_WARPS = 8  # warps per block in `fused_add`
VEC = 8  # elements per load in `fused_add` where a row's width allows (16 bytes of bf16)
TILE = 8  # tokens of one slot a block takes: each element of A and B it reads serves them all
# Outputs of a module a block of `fused_add` takes at most: one pass of its threads' loads.
BLOCK_OUTPUTS = FUSED_WARPS * 32 * VEC
# Blocks a tile of a module takes at least: a narrow module's z is split over them, so that a
# tile's sums are not one block's long loop over the input.
MIN_BLOCKS = 4

_LOADS_HEADER = """
// E elements of p as floats. With V (the caller checked that p starts on 16 bytes), one 16-byte
// load per 16 bytes; otherwise element by element. The check is made once per block, not per
// load: a branch between loads keeps the compiler from issuing them together, and a block's
// loads then wait for memory one after another.
template <bool V, typename T, int E>
__device__ __forceinline__ void mlxserve_load(const T* p, float (&f)[E]) {
  if constexpr (V && (E * sizeof(T)) % 16 == 0) {
    constexpr int W = (E * sizeof(T)) / 16;
    uint4 u[W];
#pragma unroll
    for (int w = 0; w < W; ++w) u[w] = reinterpret_cast<const uint4*>(p)[w];
    const T* e = reinterpret_cast<const T*>(u);
#pragma unroll
    for (int j = 0; j < E; ++j) f[j] = static_cast<float>(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) f[j] = static_cast<float>(p[j]);
  }
}

// mlxserve_load with the check made here, for loads whose order a branch does not hold up.
template <typename T, int E>
__device__ __forceinline__ void mlxserve_load_any(const T* p, float (&f)[E]) {
  if ((reinterpret_cast<size_t>(p) & 15) == 0) {
    mlxserve_load<true, T, E>(p, f);
  } else {
    mlxserve_load<false, T, E>(p, f);
  }
}

// Whether p starts on 16 bytes and so does every row of `stride` elements after it.
template <typename T>
__device__ __forceinline__ bool mlxserve_aligned(const T* p, int stride) {
  return (reinterpret_cast<size_t>(p) & 15) == 0 && (stride * sizeof(T)) % 16 == 0;
}

"""

_FUSED_HEADER = """
// *p read from L2 (another block of the launch wrote it), as a float.
template <typename T>
__device__ __forceinline__ float mlxserve_ldcg(const T* p) {
  if constexpr (sizeof(T) == 2) {
    const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
    return static_cast<float>(*reinterpret_cast<const T*>(&u));
  } else {
    return static_cast<float>(__ldcg(p));
  }
}

// The launch's blocks in the order they start: the first to start takes ticket 0 (counts[0] of
// the launch's own zeroed counts), the next 1, and so on. A block that waits for others of its
// tile (mlxserve_tile_wait) then only waits for blocks with lower tickets, which have started, or
// for blocks of its own tile, which start as soon as any block ends: a launch cannot stall with
// every resident block waiting for one that is not.
__device__ __forceinline__ int mlxserve_ticket(unsigned int* counts) {
  __shared__ int mine;
  if (threadIdx.x == 0) mine = (int)atomicAdd(counts, 1u);
  __syncthreads();
  return mine;
}

// Arrive at the tile's count after the block's writes (made visible to the device first), then
// wait until it reaches `target`, every block of the tile having arrived as often; what those
// blocks wrote before arriving is then to be read from L2 (__ldcg). A count that never gets
// there (a broken launch) ends the kernel with an error rather than hanging the process.
__device__ __forceinline__ void mlxserve_tile_wait(unsigned int* count, const unsigned int target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(count, 1u);
    unsigned int seen;
    unsigned int polls = 0;
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
      if (seen >= target) break;
      if (++polls == (1u << 26)) __trap();
      __nanosleep(32);
    }
  }
  __syncthreads();
}

// The block's tile of tokens. Tokens of one slot (idx, in token order) fall in tiles of TT; tile
// `tile` of the list (the first tile of each slot's tokens in the order of their first token)
// is the block's. Returns its slot (-1: no such tile) with its tokens in toks[0, n); the
// caller's threads all call it (it holds barriers). lead: the token whose tile a block finds,
// shared memory of the block's threads, as are toks and info.
template <int TT>
__device__ __forceinline__ int mlxserve_tile(
    const int32_t* idx, const int T, const int tile, int* toks, int* info) {
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warps = blockDim.x / 32;
  __shared__ int counts[32];  // leaders per warp, then their prefix
  if (tid == 0) info[0] = -1;
  int before = 0;  // leaders in earlier rounds of blockDim.x tokens
  for (int t0 = 0; t0 < T; t0 += blockDim.x) {
    const int t = t0 + tid;
    bool lead = false;
    if (t < T) {
      // A token leads a tile when the tokens of its slot before it are a multiple of TT.
      const int s = idx[t];
      int r = 0;
      for (int u = 0; u < t; ++u) r += idx[u] == s;
      lead = r % TT == 0;
    }
    const unsigned ballot = __ballot_sync(0xffffffff, lead);
    if (lane == 0) counts[warp] = __popc(ballot);
    __syncthreads();
    int prior = before;
    for (int w = 0; w < warp; ++w) prior += counts[w];
    if (lead && prior + __popc(ballot & ((1u << lane) - 1)) == tile) {
      info[0] = idx[t];
      info[1] = t;
    }
    for (int w = 0; w < warps; ++w) before += counts[w];
    __syncthreads();
  }
  const int slot = info[0];
  if (slot >= 0 && tid < 32) {
    // The leader and the next TT - 1 tokens of its slot.
    const int first = info[1];
    int seen = 0;
    for (int t0 = first; t0 < T && seen < TT; t0 += 32) {
      const int t = t0 + lane;
      const bool match = t < T && idx[t] == slot;
      const unsigned ballot = __ballot_sync(0xffffffff, match);
      const int r = seen + __popc(ballot & ((1u << lane) - 1));
      if (match && r < TT) toks[r] = t;
      seen += __popc(ballot);
    }
    if (lane == 0) info[2] = seen < TT ? seen : TT;
  }
  __syncthreads();
  return slot;
}

// One level of mlxserve_warp_sums: lanes with bit OFF set keep values [OFF, 2 * OFF) of the
// first 2 * OFF, the others [0, OFF); each adds its partner's share of what it keeps. (OFF is a
// template value so that the loop unrolls and v stays in registers.)
template <int OFF>
__device__ __forceinline__ void mlxserve_warp_level(float (&v)[32]) {
  const bool upper = (threadIdx.x % 32) & OFF;
#pragma unroll
  for (int i = 0; i < OFF; ++i) {
    const float send = upper ? v[i] : v[i + OFF];
    const float keep = upper ? v[i + OFF] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffff, send, OFF);
  }
}

// Butterfly sum over a warp's lanes of 32 values a lane: lane l ends with value l's sum in v[0].
// Every value is summed over the same tree of lanes (pairs by lane bit 16, then 8, ..., 1), so a
// value's sum does not depend on where it sits among the 32.
__device__ __forceinline__ void mlxserve_warp_sums(float (&v)[32]) {
  mlxserve_warp_level<16>(v);
  mlxserve_warp_level<8>(v);
  mlxserve_warp_level<4>(v);
  mlxserve_warp_level<2>(v);
  mlxserve_warp_level<1>(v);
}

// z[j * R + k] = x[toks[j]][lo:hi] @ A[s][lo:hi, k] for the tile's TT token places (float32,
// shared memory; places past n repeat the last token), for s > 0 (as: A[s]); lo a multiple of EI.
// Every thread takes EI inputs at a
// time for all TT places and KG ranks at once (registers), so each element of A is read once for
// the tile; the lanes' sums meet in a butterfly, the warps' in shared memory (zw: WARPS * TT *
// KG floats). A token's sums run over the same threads in the same order whatever the tile holds
// beside it.
template <bool V, typename TX, typename TA, int IN, int R, int WARPS, int EI, int TT, int KG>
__device__ __forceinline__ void mlxserve_lora_zpart(
    const TX* x, const int* toks, const int n, const TA* as, const int lo, const int hi, float* zw,
    float* z) {
  constexpr int THREADS = WARPS * 32;
  static_assert((TT * KG) % 32 == 0, "a tile's sums go 32 at a time through the butterfly");
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const TX* xr[TT];
#pragma unroll
  for (int j = 0; j < TT; ++j) xr[j] = x + (size_t)toks[j < n ? j : n - 1] * IN;
  for (int k0 = 0; k0 < R; k0 += KG) {
    float acc[TT * KG];
#pragma unroll
    for (int q = 0; q < TT * KG; ++q) acc[q] = 0.0f;
    for (int i = lo + tid * EI; i < hi; i += THREADS * EI) {
      float xv[TT][EI];
#pragma unroll
      for (int j = 0; j < TT; ++j) mlxserve_load<V, TX, EI>(xr[j] + i, xv[j]);
#pragma unroll
      for (int k = 0; k < KG; ++k) {
        if (R % KG == 0 || k0 + k < R) {
          float av[EI];
          mlxserve_load<V, TA, EI>(as + (size_t)(k0 + k) * IN + i, av);
#pragma unroll
          for (int j = 0; j < TT; ++j) {
#pragma unroll
            for (int e = 0; e < EI; ++e) acc[j * KG + k] += xv[j][e] * av[e];
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < TT * KG; g += 32) {
      float v[32];
#pragma unroll
      for (int q = 0; q < 32; ++q) v[q] = acc[g + q];
      mlxserve_warp_sums(v);
      zw[warp * TT * KG + g + lane] = v[0];
    }
    __syncthreads();
    for (int q = tid; q < TT * KG; q += THREADS) {
      const int j = q / KG, k = k0 + q % KG;
      float v = 0.0f;
      for (int w = 0; w < WARPS; ++w) v += zw[w * TT * KG + q];
      if (k < R) z[j * R + k] = v;
    }
    __syncthreads();
  }
}

// acc[j][e] = z[j] @ B[s][:, o + e] for the tile's TT token places, EO consecutive outputs from o
// (bs: B[s], rows of OUT). Ranks in order, several ranks' loads in flight at once.
template <bool V, typename TB, int R, int OUT, int EO, int TT>
__device__ __forceinline__ void mlxserve_lora_expand(
    const float* z, const TB* bs, const int o, float (&acc)[TT][EO]) {
#pragma unroll
  for (int j = 0; j < TT; ++j) {
#pragma unroll
    for (int e = 0; e < EO; ++e) acc[j][e] = 0.0f;
  }
#pragma unroll 8
  for (int k = 0; k < R; ++k) {
    float bv[EO];
    mlxserve_load<V, TB, EO>(bs + (size_t)k * OUT + o, bv);
#pragma unroll
    for (int j = 0; j < TT; ++j) {
#pragma unroll
      for (int e = 0; e < EO; ++e) acc[j][e] += z[j * R + k] * bv[e];
    }
  }
}

// Outputs [first, last) of r[t] = y[t] + (scale[t] * z @ B[s]) cast to TY before the add (mlx-lm's
// `y + (scale * z).astype(x.dtype)`), or r[t] = y[t] where the tile has no adapter (`adapted`
// false), for the tile's tokens t = toks[j < n]; EO consecutive outputs a thread, each element of
// B read once for the tile. put(t, o, r) takes token t's outputs [o, o + EO).
template <bool V, typename TY, typename TB, int R, int OUT, int YW, int COL, int THREADS, int EO,
          int TT, typename Put>
__device__ __forceinline__ void mlxserve_lora_rows(
    const float* z, const int* toks, const int n, const TB* bs, const TY* y, const float* scale,
    const bool adapted, const int first, const int last, Put put) {
  for (int o = first + threadIdx.x * EO; o < last; o += THREADS * EO) {
    float acc[TT][EO];
    if (adapted) {
      mlxserve_lora_expand<V, TB, R, OUT, EO, TT>(z, bs, o, acc);
    }
#pragma unroll
    for (int j = 0; j < TT; ++j) {
      if (j < n) {
        const size_t t = toks[j];
        const float sc = scale[t];
        float yv[EO];
        mlxserve_load<V, TY, EO>(y + t * YW + COL + o, yv);
        TY r[EO];
#pragma unroll
        for (int e = 0; e < EO; ++e) {
          r[e] = static_cast<TY>(yv[e]);
          if (adapted) {
            const TY d = static_cast<TY>(sc * acc[j][e]);
            r[e] = static_cast<TY>(yv[e] + static_cast<float>(d));
          }
        }
        put(t, o, r);
      }
    }
  }
}

// mlxserve_lora_zpart for slot s of the stack a_t, inputs [lo, hi), its loads 16 bytes wide where
// x and A[s] allow.
template <typename TX, typename TA, int IN, int R, int WARPS, int EI, int TT>
__device__ __forceinline__ void mlxserve_lora_z(
    const TX* x, const int* toks, const int n, const TA* a_t, const int s, const int lo,
    const int hi, float* zw, float* z) {
  // Ranks a pass: 64 sums a thread (two butterflies), whole ranks of 32 / TT at a time.
  constexpr int STEP = 32 / TT;
  constexpr int RUP = (R + STEP - 1) / STEP * STEP;
  constexpr int KG = 64 / TT < RUP ? 64 / TT : RUP;
  const TA* as = a_t + (size_t)s * R * IN;
  if (mlxserve_aligned(x, IN) && mlxserve_aligned(as, IN)) {
    mlxserve_lora_zpart<true, TX, TA, IN, R, WARPS, EI, TT, KG>(x, toks, n, as, lo, hi, zw, z);
  } else {
    mlxserve_lora_zpart<false, TX, TA, IN, R, WARPS, EI, TT, KG>(x, toks, n, as, lo, hi, zw, z);
  }
}

// One block's share of a LoRA update: tile `tile` of one module's tokens (those of one slot s),
// this block the tile's `rank`-th of CS. It sums z = x[t] @ A[s] for the tile's tokens over its
// slice `rank` of the inputs (`mlxserve_lora_z`) into zp[rank] (zp: the tile's slices, ZS floats
// each), meets the tile's other blocks at its count, and adds the slices' sums in slice order (the
// same z in every block). Then it writes its OC outputs of out[t] = y[t] + (scale[t] * z @ B[s])
// cast to TY before the add (mlx-lm's `y + (scale * z).astype(x.dtype)`). x [T, IN], out [T, OUT],
// y [T, YW] of which this module's outputs are columns
// [COL, COL + OUT) (a fused projection's whole product: read in place, not copied out first),
// a_t [S, R, IN] (A transposed: a thread's EI inputs are consecutive), b [S, R, OUT].
template <typename TX, typename TY, typename TA, typename TB, int IN, int R, int OUT, int YW,
          int COL, int OC, int CS, int ZS, int WARPS, int EI, int EO, int TT>
__device__ __forceinline__ void mlxserve_lora_block(
    const TX* x, const TY* y, const TA* a_t, const TB* b, const int32_t* idx, const float* scale,
    const int T, const int tile, const int rank, unsigned int* count, float* zp, TY* out,
    float* zw, float* z) {
  constexpr int THREADS = WARPS * 32;
  __shared__ int toks[TT];
  __shared__ int info[3];
  const int s = mlxserve_tile<TT>(idx, T, tile, toks, info);
  if (s < 0) {
    return;  // past the last tile
  }
  const int n = info[2];
  const int tid = threadIdx.x;
  const int first = rank * OC;
  const int last = first + OC < OUT ? first + OC : OUT;
  if (s == 0) {
    // Local slot 0 is zeros in every stack: the update is zero, A and B need not be read.
    // (The whole tile's blocks take this path: none waits at the count.)
    for (int j = 0; j < n; ++j) {
      const size_t t = toks[j];
      for (int o = first + tid; o < last; o += THREADS) out[t * OUT + o] = y[t * YW + COL + o];
    }
    return;
  }
  constexpr int SLICE = ((IN + CS - 1) / CS + EI - 1) / EI * EI;
  const int lo = rank * SLICE < IN ? rank * SLICE : IN;
  const int hi = lo + SLICE < IN ? lo + SLICE : IN;
  mlxserve_lora_z<TX, TA, IN, R, WARPS, EI, TT>(x, toks, n, a_t, s, lo, hi, zw, z);
  float* mine = zp + (size_t)rank * ZS;
  for (int e = tid; e < TT * R; e += THREADS) mine[e] = z[e];
  mlxserve_tile_wait(count, CS);
  for (int e = tid; e < TT * R; e += THREADS) {
    float v = __ldcg(zp + e);
    for (int p = 1; p < CS; ++p) v += __ldcg(zp + (size_t)p * ZS + e);
    z[e] = v;
  }
  __syncthreads();
  const TB* bs = b + (size_t)s * R * OUT;
  auto put = [&](const size_t t, const int o, const TY (&r)[EO]) {
#pragma unroll
    for (int e = 0; e < EO; ++e) out[t * OUT + o + e] = r[e];
  };
  if (mlxserve_aligned(bs, OUT) && mlxserve_aligned(y + COL, YW)) {
    mlxserve_lora_rows<true, TY, TB, R, OUT, YW, COL, THREADS, EO, TT>(
        z, toks, n, bs, y, scale, true, first, last, put);
  } else {
    mlxserve_lora_rows<false, TY, TB, R, OUT, YW, COL, THREADS, EO, TT>(
        z, toks, n, bs, y, scale, true, first, last, put);
  }
}
"""


def kernel_header(extra: str = "") -> str:
    """`fused_add`'s device functions, then `extra` (another kernel's own)."""
    return _LOADS_HEADER + _FUSED_HEADER + extra


def _fused_source(parts: int) -> str:
    """The kernel body for `parts` modules: the blocks of part p follow those of the parts before
    it, CS{p} for each of its tiles (`tiles`: how many there can be), in ticket order
    (`mlxserve_ticket`); a tile's blocks meet at counts[1 + its first ticket]."""
    lines = [
        "    const int T = idx0_shape[0];",
        "    __shared__ float zw[WARPS * 64];",
        "    __shared__ float z[TT * RMAX];",
        "    // counts are the launch's own to change (`Counts`): MLX passes inputs as const.",
        "    unsigned int* count =",
        "        const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(counts));",
        "    // After the counts (one a block and the ticket counter), each block's z slice.",
        "    float* zp = reinterpret_cast<float*>(count + 1 + gridDim.x);",
        "    const int ticket = mlxserve_ticket(count);",
        "    int block = ticket;",
    ]
    for p in range(parts):
        lines += [
            "    {",
            f"        const int slots = a{p}_shape[0] < T ? a{p}_shape[0] : T;",
            f"        const int blocks = ((T + TT - 1) / TT + slots - 1) * CS{p};",
            "        if (block < blocks) {",
            "            // The tile, and the share of its outputs the block takes.",
            f"            const int tile = block / CS{p}, rank = block % CS{p};",
            f"            mlxserve_lora_block<TX, TY{p}, TA{p}, TB{p}, IN, R{p}, OUT{p},",
            f"                                YW{p}, COL{p}, OC{p}, CS{p}, TT * RMAX,",
            f"                                WARPS, EI, EO{p}, TT>(",
            f"                x, y{p}, a{p}, b{p}, idx{p}, scale, T, tile, rank,",
            "                count + 1 + (ticket - rank),",
            "                zp + (size_t)(ticket - rank) * TT * RMAX,",
            f"                out{p}, zw, z);",
            "            return;",
            "        }",
            "        block -= blocks;",
            "    }",
        ]
    return "\n".join(lines) + "\n"


def tiles(tokens: int, slots: int) -> int:
    """The most tiles `fused_add` can make of `tokens` tokens over a stack of `slots` local
    slots: a tile per TILE tokens, and one more for each slot present but the first."""
    return -(-tokens // TILE) + min(slots, tokens) - 1


@dataclass(frozen=True)
class Part:
    """One module's share of a `fused_add` call."""

    y: mx.array  # the base layer's output [..., out], or a wider array holding it (`start`)
    a_t: mx.array  # A as [S, r, in]
    b: mx.array  # [S, r, out]
    idx: mx.array  # int32 [tokens]: each token's local slot in this module's stacks
    start: int = 0  # the base output is y's columns [start, start + out)

    @property
    def width(self) -> int:
        return self.b.shape[-1]

    def base(self) -> mx.array:
        """The base layer's output [..., out]."""
        return _columns(self.y, self.start, self.width)


@dataclass(frozen=True)
class Deferred:
    """The pieces of `fused_add(x, [part], scale)`: a one-part update that the residual add after
    its projection may make instead (service.core.models.residual_norm.defer)."""

    x: mx.array
    part: Part
    scale: mx.array
    counts: Counts | None = None  # the forward's, for the fold's launch; None: a fill of its own


def _columns(y: mx.array, start: int, width: int) -> mx.array:
    """y's columns [start, start + width): y itself when that is all of it."""
    return y if y.shape[-1] == width else y[..., start : start + width]


@cache
def _fused(parts: int) -> Any:
    names = [f"{n}{p}" for p in range(parts) for n in ("y", "a", "b", "idx")]
    return cuda_kernel(
        # One name per source: MLX before 0.32.1 caches a compiled kernel by its name and
        # template arguments, not its source.
        name=f"mlxserve_lora_fused{parts}",
        input_names=["x", "scale", *names, "counts"],
        output_names=[f"out{p}" for p in range(parts)],
        source=_fused_source(parts),
        header=kernel_header(),
    )


def vector(width: int) -> int:
    """Elements per load along a row of this width in `fused_add`."""
    return VEC if width % VEC == 0 else 1


def blocks(width: int) -> int:
    """Blocks a tile of a module with this many outputs takes in `fused_add`: one for each
    BLOCK_OUTPUTS, and at least MIN_BLOCKS."""
    return max(MIN_BLOCKS, -(-width // BLOCK_OUTPUTS))


def share(width: int) -> int:
    """Outputs of a row of this width each of a tile's blocks takes (the last ones may take fewer,
    or none): whole vector loads, `blocks(width)` shares covering the row."""
    vec = vector(width)
    per_block = -(-width // blocks(width))
    return -(-per_block // vec) * vec


def fused_add(
    x: mx.array, parts: Sequence[Part], scale: mx.array, counts: Counts | None = None
) -> list[mx.array]:
    """Each part's base output plus each token's update scale[t] * (x[t] @ A[idx[t]]) @
    B[idx[t]], in its dtype: one kernel for all parts. x [..., in] (tokens = its rows); scale
    float32 [tokens]. Parts may share one y, each reading its own columns. `counts`: the
    forward's, of which the launch takes a stretch; by default it fills its own."""
    if not available():
        return reference_fused_add(x, parts, scale)
    width = x.shape[-1]
    tokens = x.size // width
    if tokens == 0:  # CUDA launches no empty grid
        return [part.base() for part in parts]
    template: list[tuple[str, Any]] = [
        ("TX", x.dtype),
        ("IN", width),
        ("WARPS", FUSED_WARPS),
        ("EI", vector(width)),
    ]
    inputs = [x, scale]
    block_count = 0
    for p, part in enumerate(parts):
        out = part.width
        inputs += [part.y, part.a_t, part.b, part.idx]
        template += [
            (f"TY{p}", part.y.dtype),
            (f"TA{p}", part.a_t.dtype),
            (f"TB{p}", part.b.dtype),
            (f"R{p}", part.a_t.shape[1]),
            (f"OUT{p}", out),
            (f"YW{p}", part.y.shape[-1]),
            (f"COL{p}", part.start),
            (f"OC{p}", share(out)),
            (f"CS{p}", blocks(out)),
            (f"EO{p}", vector(out)),
        ]
        block_count += tiles(tokens, part.a_t.shape[0]) * blocks(out)
    template += [
        ("TT", TILE),
        ("RMAX", max(part.a_t.shape[1] for part in parts)),
    ]
    inputs.append(take_counts(counts, fused_counts(tokens, parts)))
    threads = FUSED_WARPS * 32
    return _fused(len(parts))(
        inputs=inputs,
        template=template,
        grid=(block_count * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*part.y.shape[:-1], part.width) for part in parts],
        output_dtypes=[part.y.dtype for part in parts],
    )


def fused_counts(tokens: int, parts: Sequence[Part]) -> int:
    """The int32 words a `fused_add` launch over `tokens` tokens uses: its ticket counter, one
    count for each of its blocks (a tile's blocks meet at that of its first), then each block's
    float32 z slice (`workspace`)."""
    block_count = sum(tiles(tokens, part.a_t.shape[0]) * blocks(part.width) for part in parts)
    return workspace(block_count, max(part.a_t.shape[1] for part in parts))


def workspace(block_count: int, rank: int) -> int:
    """The int32 words of a launch of `block_count` blocks whose tiles meet: the ticket counter and
    a count a block, then a block's z slice (TILE tokens by `rank`, float32) each. Only the counts
    need be zero; the slices are written before they are read. In one array with the counts, the
    slices cost the launch no output of its own (an output's host work is more than the fill's
    device work)."""
    return 1 + block_count + block_count * TILE * rank


# Fills of distinct lengths: mx.compile merges identical operations of a trace, two fills of one
# length into one array, and each launch's counts must be its own. Lengths are whole multiples of
# FILLS plus a serial below it, so that no two of the last FILLS fills (more than a trace makes)
# have one length.
FILLS = 1 << 12
_FILL_SERIALS = itertools.count()


def zeros(size: int) -> mx.array:
    """At least `size` int32 zeros, of a length unlike that of the FILLS fills before."""
    serial = next(_FILL_SERIALS) % FILLS
    return mx.zeros((-(-size // FILLS) * FILLS + serial,), mx.int32)


def take_counts(counts: Counts | None, size: int) -> mx.array:
    """`size` zeros for one launch: a stretch of the forward's `counts`, or a fill of its own."""
    if isinstance(counts, mx.array):
        raise TypeError("counts: a forward's Counts, not an array")
    return zeros(size) if counts is None else counts.take(size)


class Counts:
    """Zeroed counts for the launches of one forward whose blocks meet (`fused_add`, the fold
    of service.core.models.residual_norm), each its own stretch of one array: one fill for all
    of them, not one a launch. Each launch's counts must be its own: MLX runs a graph's kernels
    in the order of their data only, so two launches with none between them (q, k and v each
    on one x) may run at once. Nothing in a traced forward may evaluate them: an array
    evaluated while tracing becomes a constant of the compiled graph, the same array at every
    step."""

    # Words a fill makes (32 MiB): room for the counts and z slices of a decode step of an
    # 8B-sized model's 64 rows (o's and down's launches take stretches twice: their `fused_add`,
    # which a fold replaces, then the fold), with room to spare for other kernel settings; a
    # forward that needs more takes another fill.
    CHUNK = 1 << 23

    def __init__(self) -> None:
        self._zeros: mx.array | None = None
        self._room = 0  # of the fill: CHUNK, or a launch's size past it (a fill may be longer)
        self._used = 0

    def take(self, size: int) -> mx.array:
        """`size` zeros no other launch of this forward is given."""
        if self._zeros is None or self._used + size > self._room:
            self._room = max(size, self.CHUNK)
            self._zeros = zeros(self._room)
            self._used = 0
        out = self._zeros[self._used : self._used + size]
        self._used += size
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


def reference_fused_add(x: mx.array, parts: Sequence[Part], scale: mx.array) -> list[mx.array]:
    """`fused_add` from MLX ops: each part's `shrink` and `expand_add` references."""
    return _two_steps(x, parts, scale, reference_shrink, _on_columns(reference_expand_add))


def shrink_expand_add(x: mx.array, parts: Sequence[Part], scale: mx.array) -> list[mx.array]:
    """`fused_add`'s update from two kernels a part (`shrink`, then `expand_add`): each token's
    x @ A made by one kernel and read by the other, where `fused_add`'s blocks of a tile split it
    and meet (bench/lora_kernel.py --pair times the two forms)."""
    return _two_steps(x, parts, scale, shrink, _on_columns(expand_add))


Shrink = Callable[[mx.array, mx.array, mx.array], mx.array]  # (x [T, in], A as [S, r, in], idx)
Expand = Callable[[mx.array, mx.array, Part, mx.array], mx.array]  # (y [T, YW], z, part, scale)


def _two_steps(
    x: mx.array, parts: Sequence[Part], scale: mx.array, shrink_fn: Shrink, expand_fn: Expand
) -> list[mx.array]:
    """Each part's z = x @ A[idx], then its base output plus scale * z @ B[idx]. `expand_fn`
    takes the part's y whole, as [T, YW] (the base output its columns from `part.start`)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return [part.base() for part in parts]
    out = []
    for part in parts:
        y = part.y.reshape(-1, part.y.shape[-1])
        z = shrink_fn(flat, part.a_t, part.idx)
        out.append(expand_fn(y, z, part, scale).reshape(*part.y.shape[:-1], part.width))
    return out


def _on_columns(
    expand: Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], mx.array],
) -> Expand:
    """An expand_add form that takes the base output alone, given it sliced out of y."""

    def run(y: mx.array, z: mx.array, part: Part, scale: mx.array) -> mx.array:
        return expand(_columns(y, part.start, part.width), z, part.b, part.idx, scale)

    return run


# -- passes of many tokens a row (prefill) --------------------------------------------------------
#
# `fused_add` and the pair above read a token's A and B anew for each token, which at a prefill
# pass's thousands of tokens is most of the update's cost, though a prompt's tokens share one
# adapter. These kernels take tiles of up to TILE_TOKENS consecutive tokens of one row (rows of
# `row_tokens` tokens, as a [B, L, in] forward's): a tile's z comes from one read of its slot's A,
# staged in shared memory with the tile's inputs, and each output column of the tile from one read
# of B. The row length is an input, not a template value, so a new prompt length compiles nothing.
# A tile whose tokens hold different slots (not a forward's rows) takes each token's own slot.
# `rows_add` serves such passes (service.core.models.lora); `bench/lora_kernel.py --prefill` times
# them.

TILE_TOKENS = 16
TILE_THREADS = 256

_TILE_HEADER = """
#ifndef MLXSERVE_TILE
#define MLXSERVE_TILE
// The tile of block `tile`: rows of L tokens, ceil(L / TT) tiles a row; its first token and
// its number of tokens.
__device__ __forceinline__ void mlxserve_tile(int tile, int L, int TT, size_t& t0, int& n) {
  const int per_row = (L + TT - 1) / TT;
  const int row = tile / per_row;
  const int j = tile % per_row;
  t0 = (size_t)row * L + (size_t)j * TT;
  n = L - j * TT < TT ? L - j * TT : TT;
}
#endif
"""

_SHRINK_ROWS = """
    // z[t] = x[t] @ A[s] for the tile's tokens (float32): pairs (token j, rank k) over the
    // threads; inputs in chunks of CI (a multiple of 4) staged in shared memory with A[s]'s.
    size_t t0;
    int n;
    mlxserve_tile(blockIdx.x, rows[0], TT, t0, n);
    const int tid = threadIdx.x;
    const int s0 = idx[t0];
    bool uniform = true;
    for (int j = 1; j < n; ++j) uniform = uniform && idx[t0 + j] == s0;
    float acc[PAIRS];
#pragma unroll
    for (int q = 0; q < PAIRS; ++q) acc[q] = 0.0f;
    if (uniform && s0 != 0) {
        // Rows of CP floats: 16-byte aligned for float4 reads, and rows of successive ranks
        // start 4 banks apart.
        constexpr int CP = CI + 4;
        __shared__ __align__(16) float xs[TT * CP];
        __shared__ __align__(16) float at[R * CP];
        for (int i0 = 0; i0 < IN; i0 += CI) {
            const int width = IN - i0 < CI ? IN - i0 : CI;
            for (int e = tid; e < TT * CI; e += THREADS) {
                const int j = e / CI, i = e % CI;
                xs[j * CP + i] =
                    j < n && i < width ? static_cast<float>(x[(t0 + j) * IN + i0 + i]) : 0.0f;
            }
            for (int e = tid; e < R * CI; e += THREADS) {
                const int k = e / CI, i = e % CI;
                at[k * CP + i] =
                    i < width ? static_cast<float>(a_t[((size_t)s0 * R + k) * IN + i0 + i]) : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int q = 0; q < PAIRS; ++q) {
                const int p = tid + q * THREADS;
                if (p < TT * R) {
                    const float4* xr = reinterpret_cast<const float4*>(xs + (p / R) * CP);
                    const float4* ar = reinterpret_cast<const float4*>(at + (p % R) * CP);
                    float v = acc[q];
                    for (int i = 0; i < CI / 4; ++i) {
                        const float4 u = xr[i], w = ar[i];
                        v += u.x * w.x + u.y * w.y + u.z * w.z + u.w * w.w;
                    }
                    acc[q] = v;
                }
            }
            __syncthreads();
        }
    } else if (!uniform) {
        // Not one row's tokens: each token's own slot, read from global memory.
#pragma unroll
        for (int q = 0; q < PAIRS; ++q) {
            const int p = tid + q * THREADS;
            const int j = p / R, k = p % R;
            if (p < TT * R && j < n) {
                const size_t s = (size_t)idx[t0 + j];
                const TX* xr = x + (t0 + j) * IN;
                const TA* ar = a_t + (s * R + k) * IN;
                float v = 0.0f;
                for (int i = 0; i < IN; ++i) {
                    v += static_cast<float>(xr[i]) * static_cast<float>(ar[i]);
                }
                acc[q] = v;
            }
        }
    }
#pragma unroll
    for (int q = 0; q < PAIRS; ++q) {
        const int p = tid + q * THREADS;
        const int j = p / R;
        if (p < TT * R && j < n) z[(t0 + j) * R + p % R] = acc[q];
    }
"""

_EXPAND_ADD_ROWS = """
    // out[t, o] = y[t, COL + o] + (scale[t] * z[t] @ B[s])[o] cast to TY before the add, for the
    // tile's tokens and this block's chunk of EO * THREADS columns: each B[s] element read once
    // for the tile's tokens.
    const int tile = blockIdx.x / CHUNKS;
    const int chunk = blockIdx.x % CHUNKS;
    size_t t0;
    int n;
    mlxserve_tile(tile, rows[0], TT, t0, n);
    const int tid = threadIdx.x;
    __shared__ float zs[TT * R];
    __shared__ float sc[TT];
    __shared__ int sl[TT];
    for (int e = tid; e < TT * R; e += THREADS) {
        const int j = e / R;
        zs[e] = j < n ? z[(t0 + j) * R + e % R] : 0.0f;
    }
    for (int j = tid; j < TT; j += THREADS) {
        sc[j] = j < n ? scale[t0 + j] : 0.0f;
        sl[j] = j < n ? idx[t0 + j] : 0;
    }
    __syncthreads();
    const int o = (chunk * THREADS + tid) * EO;
    if (o >= OUT) {
        return;
    }
    const int s0 = sl[0];
    bool uniform = true;
    for (int j = 1; j < n; ++j) uniform = uniform && sl[j] == s0;
    float acc[TT][EO];
#pragma unroll
    for (int j = 0; j < TT; ++j) {
#pragma unroll
        for (int e = 0; e < EO; ++e) acc[j][e] = 0.0f;
    }
    if (uniform) {
        if (s0 != 0) {
            for (int k = 0; k < R; ++k) {
                float bv[EO];
                mlxserve_load_any<TB, EO>(b + ((size_t)s0 * R + k) * OUT + o, bv);
#pragma unroll
                for (int j = 0; j < TT; ++j) {
                    const float zk = zs[j * R + k];
#pragma unroll
                    for (int e = 0; e < EO; ++e) acc[j][e] += zk * bv[e];
                }
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            const int s = sl[j];
            if (j < n && s != 0) {
                for (int k = 0; k < R; ++k) {
                    float bv[EO];
                    mlxserve_load_any<TB, EO>(b + ((size_t)s * R + k) * OUT + o, bv);
#pragma unroll
                    for (int e = 0; e < EO; ++e) acc[j][e] += zs[j * R + k] * bv[e];
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < TT; ++j) {
        if (j < n) {
            float yv[EO];
            mlxserve_load_any<TY, EO>(y + (t0 + j) * YW + COL + o, yv);
#pragma unroll
            for (int e = 0; e < EO; ++e) {
                const TY d = static_cast<TY>(sc[j] * acc[j][e]);
                out[(t0 + j) * OUT + o + e] = static_cast<TY>(yv[e] + static_cast<float>(d));
            }
        }
    }
"""


@cache
def _shrink_rows() -> Any:
    return cuda_kernel(
        name="mlxserve_lora_shrink_rows",
        input_names=["x", "a_t", "idx", "rows"],
        output_names=["z"],
        source=_SHRINK_ROWS,
        header=_TILE_HEADER,
    )


@cache
def _expand_add_rows() -> Any:
    return cuda_kernel(
        name="mlxserve_lora_expand_add_rows",
        input_names=["y", "z", "b", "idx", "scale", "rows"],
        output_names=["out"],
        source=_EXPAND_ADD_ROWS,
        header=_LOADS_HEADER + _TILE_HEADER,
    )


@cache
def _row_length(row_tokens: int) -> mx.array:
    """The row length as the kernels' input (kept: one array per length), in device memory
    (device_memory: an input, not a template value, so a prefill pass's length does not compile
    a kernel)."""
    return resident(np.array([row_tokens], np.int32))


def _tiles(tokens: int, row_tokens: int) -> int:
    return (tokens // row_tokens) * -(-row_tokens // TILE_TOKENS)


def input_chunk(rank: int) -> int:
    """Inputs staged per pass in `shrink_rows` (a multiple of 4, its float4 reads): shared memory
    for about 4096 of (rank x chunk)."""
    return max(16, min(128, 4096 // rank)) // 4 * 4


def shrink_rows(x: mx.array, a_t: mx.array, idx: mx.array, row_tokens: int) -> mx.array:
    """`shrink` over rows of `row_tokens` tokens (x [T, in], T a multiple of it), a tile of a
    row's tokens reading its slot's A once."""
    if not available():
        return reference_shrink(x, a_t, idx)
    tokens, width = x.shape
    rank = a_t.shape[1]
    (z,) = _shrink_rows()(
        inputs=[x, a_t, idx, _row_length(row_tokens)],
        template=[
            ("TX", x.dtype),
            ("TA", a_t.dtype),
            ("IN", width),
            ("R", rank),
            ("TT", TILE_TOKENS),
            ("CI", input_chunk(rank)),
            ("THREADS", TILE_THREADS),
            ("PAIRS", -(-TILE_TOKENS * rank // TILE_THREADS)),
        ],
        grid=(_tiles(tokens, row_tokens) * TILE_THREADS, 1, 1),
        threadgroup=(TILE_THREADS, 1, 1),
        output_shapes=[(tokens, rank)],
        output_dtypes=[mx.float32],
    )
    return z


def expand_add_rows(
    y: mx.array,
    z: mx.array,
    b: mx.array,
    idx: mx.array,
    scale: mx.array,
    row_tokens: int,
    start: int = 0,
) -> mx.array:
    """`expand_add` over rows of `row_tokens` tokens: y [T, YW] whose columns [start, start +
    out) are the base output (read in place), out [T, out]; each B element read once a tile."""
    width = b.shape[-1]
    if not available():
        return reference_expand_add(_columns(y, start, width), z, b, idx, scale)
    tokens = y.shape[0]
    eo = 4 if width % 4 == 0 else 1
    chunks = -(-width // (TILE_THREADS * eo))
    (out,) = _expand_add_rows()(
        inputs=[y, z, b, idx, scale, _row_length(row_tokens)],
        template=[
            ("TY", y.dtype),
            ("TB", b.dtype),
            ("R", b.shape[1]),
            ("OUT", width),
            ("YW", y.shape[-1]),
            ("COL", start),
            ("TT", TILE_TOKENS),
            ("EO", eo),
            ("THREADS", TILE_THREADS),
            ("CHUNKS", chunks),
        ],
        grid=(_tiles(tokens, row_tokens) * chunks * TILE_THREADS, 1, 1),
        threadgroup=(TILE_THREADS, 1, 1),
        output_shapes=[(tokens, width)],
        output_dtypes=[y.dtype],
    )
    return out


def rows_add(
    x: mx.array, parts: Sequence[Part], scale: mx.array, row_tokens: int
) -> list[mx.array]:
    """`fused_add`'s outputs from `shrink_rows` and `expand_add_rows` per part, for x's tokens
    in rows of `row_tokens` (a [B, L, in] forward: L)."""
    return _two_steps(
        x,
        parts,
        scale,
        lambda flat, a_t, idx: shrink_rows(flat, a_t, idx, row_tokens),
        lambda y, z, part, s: expand_add_rows(y, z, part.b, part.idx, s, row_tokens, part.start),
    )
