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

A LoRA row's update to the projection before an add (attention's o_proj, the MLP's down_proj) is
made here too, when the projection deferred it (`defer`: service.core.models.lora, one token a
row): `add_update_rms_norm` computes base + update, the sum and its norm in one kernel, one kernel
a projection fewer than the update's own `fused_add` then this add. A tile's SLICES blocks each
sum z over a slice of the input, meet (`lora_kernel.Counts`), each make a share of the
columns of r and h, meet again, and each make every token's sum of squares over its whole row of
h (read back) in `add_rms_norm`'s order and the norm of its columns. So z differs from
`fused_add`'s in the order of its sum (float tolerance), a token's numbers do not depend on the
rows beside it, and the sum and its norm are `add_rms_norm`'s bit for bit. The projection's own
output (the update's kernel) is then never read and never run.
"""

from __future__ import annotations

import threading
import weakref
from functools import cache
from typing import Any, Generic, TypeVar

import mlx.core as mx
import mlx.nn as nn

from service.core.engine.device_memory import float_bits
from service.core.engine.kernel_source import cuda_kernel
from service.core.engine.paged_attention import kernel_available as available
from service.core.models import lora_kernel

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
    return cuda_kernel(
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
    """(h, rms_norm(h)) for h = x + r: one kernel where `supported`, else MLX's two ops. When r
    is a deferred update's output (`defer`), the update is made here (`add_update_rms_norm`)."""
    update = _PER_THREAD.update.payload_of(r)
    if update is not None:
        return add_update_rms_norm(x, update, weight, eps)
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


_FOLD_HEADER = """
// Shared memory a fold's block stages its tile's h rows through for the norm's sums.
constexpr int MLXSERVE_STAGE_BYTES = 16384;

// The h of a tile's tokens at columns [first, last): h = T(x + r) as add_rms_norm rounds it, for
// r the projection's output with its update (mlxserve_lora_rows: base where s is 0).
template <bool V, typename T, typename TB, int R, int D, int YW, int COL, int THREADS, int EO,
          int TT>
__device__ __forceinline__ void mlxserve_fold_rows(
    const T* x, const T* base, const TB* bs, const float* scale, const int s, const float* z,
    const int* toks, const int n, const int first, const int last, T* h) {
  auto put = [&](const size_t t, const int o, const T (&r)[EO]) {
    float xv[EO];
    mlxserve_load<V, T, EO>(x + t * D + o, xv);
#pragma unroll
    for (int e = 0; e < EO; ++e) {
      h[t * D + o + e] = static_cast<T>(xv[e] + static_cast<float>(r[e]));
    }
  };
  mlxserve_lora_rows<V, T, TB, R, D, YW, COL, THREADS, EO, TT>(
      z, toks, n, bs, base, scale, s != 0, first, last, put);
}

// A tile's residual add and norm, the projection's LoRA update made here, by the tile's SPLIT
// blocks side by side, which meet twice at the tile's count. Block q sums z over its slice q of
// the inputs (whole loads of EI) into zp; once all have, each adds the slices' sums in slice order
// (the same z in every block, whatever finished first) and makes its share q of the columns of
// the tile's rows of r and h. Once all have, each makes every token's sum of squares over the
// whole h row in add_rms_norm's order (on its first NT threads: thread tid takes elements tid,
// tid + NT, ...; lanes, then warps in order), the same in every block, and the norm of its own
// columns. The count (the launch's own, from zero) goes to SPLIT, then 2 * SPLIT. A tile without
// an adapter (s = 0) needs no z, and still meets before the norm.
template <typename T, typename TX, typename TA, typename TB, int D, int IN, int R, int YW,
          int COL, int WARPS, int EI, int EO, int TT, int NT, int SPLIT, int EPS_BITS>
__device__ __forceinline__ void mlxserve_fold_block(
    const T* x, const T* base, const TX* lx, const TA* a_t, const TB* b, const int32_t* idx,
    const float* scale, const T* w, unsigned int* count, const int tokens, const int tile,
    const int q, T* h, T* out, float* zp, float* zw, float* z) {
  constexpr int THREADS = WARPS * 32;
  static_assert(THREADS >= NT && NT % 32 == 0, "the norm's sums run on add_rms_norm's threads");
  constexpr int SLICE = ((IN + SPLIT - 1) / SPLIT + EI - 1) / EI * EI;
  constexpr int COLS = ((D + SPLIT - 1) / SPLIT + EO - 1) / EO * EO;
  __shared__ int toks[TT];
  __shared__ int info[3];
  __shared__ float warp_sums[TT * (NT / 32)];
  __shared__ float totals[TT];
  const int s = mlxserve_tile<TT>(idx, tokens, tile, toks, info);
  if (s < 0) {
    return;  // past the last tile: so are the tile's other blocks
  }
  const int n = info[2];
  const int tid = threadIdx.x;
  if (s != 0) {
    const int lo = q * SLICE < IN ? q * SLICE : IN;
    const int hi = lo + SLICE < IN ? lo + SLICE : IN;
    mlxserve_lora_z<TX, TA, IN, R, WARPS, EI, TT>(lx, toks, n, a_t, s, lo, hi, zw, z);
    float* mine = zp + ((size_t)tile * SPLIT + q) * TT * R;
    for (int e = tid; e < TT * R; e += THREADS) mine[e] = z[e];
  }
  mlxserve_tile_wait(count, SPLIT);
  if (s != 0) {
    const float* slices = zp + (size_t)tile * SPLIT * TT * R;
    for (int e = tid; e < TT * R; e += THREADS) {
      float v = __ldcg(slices + e);
      for (int p = 1; p < SPLIT; ++p) v += __ldcg(slices + (size_t)p * TT * R + e);
      z[e] = v;
    }
    __syncthreads();
  }
  const int first = q * COLS < D ? q * COLS : D;
  const int last = first + COLS < D ? first + COLS : D;
  const TB* bs = b + (size_t)(s > 0 ? s : 0) * R * D;
  if (mlxserve_aligned(bs, D) && mlxserve_aligned(base + COL, YW) && mlxserve_aligned(x, D)) {
    mlxserve_fold_rows<true, T, TB, R, D, YW, COL, THREADS, EO, TT>(
        x, base, bs, scale, s, z, toks, n, first, last, h);
  } else {
    mlxserve_fold_rows<false, T, TB, R, D, YW, COL, THREADS, EO, TT>(
        x, base, bs, scale, s, z, toks, n, first, last, h);
  }
  mlxserve_tile_wait(count, 2 * SPLIT);
  // Each token's sum of squares in add_rms_norm's order: thread tid < NT adds elements tid,
  // tid + NT, ... of each row in turn. The tile's rows come through shared memory a stretch of
  // STAGE columns at a time, loaded by all the block's threads in 16-byte loads side by side (a
  // thread's own elements one load after another would leave L2's latency unhidden).
  constexpr int STAGE = (MLXSERVE_STAGE_BYTES / (TT * (int)sizeof(T))) / NT * NT;
  static_assert(STAGE >= NT, "a stage holds at least one element a thread");
  constexpr int PER = STAGE / NT;
  constexpr int EV = 16 / (int)sizeof(T);  // elements a 16-byte load
  __shared__ __align__(16) T stage[TT * STAGE];
  float squares[TT];
#pragma unroll
  for (int j = 0; j < TT; ++j) squares[j] = 0.0f;
  const bool wide = D % EV == 0 && STAGE % EV == 0 && mlxserve_aligned(h, D);
  for (int c0 = 0; c0 < D; c0 += STAGE) {
    const int width = D - c0 < STAGE ? D - c0 : STAGE;
    if (wide) {  // every load issued before the first store
      constexpr int LOADS = (TT * STAGE / EV + THREADS - 1) / THREADS;
      uint4 v[LOADS];
#pragma unroll
      for (int l = 0; l < LOADS; ++l) {
        const int e = (tid + l * THREADS) * EV;
        const int j = e / STAGE;
        const int c = e - j * STAGE;
        if (j < n && c < width) {
          v[l] = __ldcg(reinterpret_cast<const uint4*>(h + (size_t)toks[j] * D + c0 + c));
        }
      }
#pragma unroll
      for (int l = 0; l < LOADS; ++l) {
        const int e = (tid + l * THREADS) * EV;
        const int j = e / STAGE;
        if (j < n && e - j * STAGE < width) {
          *reinterpret_cast<uint4*>(stage + e) = v[l];
        }
      }
    } else {
      for (int e = tid; e < n * STAGE; e += THREADS) {
        const int j = e / STAGE;
        const int c = e - j * STAGE;
        if (c < width) {
          stage[e] = static_cast<T>(mlxserve_ldcg(h + (size_t)toks[j] * D + c0 + c));
        }
      }
    }
    __syncthreads();
    if (tid < NT) {  // whole warps
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int c = tid + k * NT;
        if (c < width) {
#pragma unroll
          for (int j = 0; j < TT; ++j) {
            if (j < n) {
              const float v = static_cast<float>(stage[j * STAGE + c]);
              squares[j] += v * v;
            }
          }
        }
      }
    }
    __syncthreads();
  }
  if (tid < NT) {
#pragma unroll
    for (int j = 0; j < TT; ++j) {
      for (int offset = 16; offset > 0; offset /= 2) {
        squares[j] += __shfl_xor_sync(0xffffffff, squares[j], offset);
      }
      if (tid % 32 == 0) {
        warp_sums[j * (NT / 32) + tid / 32] = squares[j];
      }
    }
  }
  __syncthreads();
  if (tid < n) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < NT / 32; ++k) total += warp_sums[tid * (NT / 32) + k];
    totals[tid] = total;
  }
  __syncthreads();
  for (int i = first + tid; i < last; i += THREADS) {
    for (int j = 0; j < n; ++j) {
      const size_t at = (size_t)toks[j] * D + i;
      const float normalizer = rsqrt(totals[j] / D + __int_as_float(EPS_BITS));
      out[at] = w[i] * static_cast<T>(mlxserve_ldcg(h + at) * normalizer);
    }
  }
}
"""

_FOLD_SOURCE = """
    const int tokens = idx_shape[0];
    __shared__ float zw[WARPS * 64];
    __shared__ float z[TT * R];
    // counts are the launch's own to change (`lora_kernel.Counts`): MLX passes inputs as const.
    unsigned int* count = const_cast<unsigned int*>(reinterpret_cast<const unsigned int*>(counts));
    // After the counts (one a block and the ticket counter), each block's z slice.
    float* zp = reinterpret_cast<float*>(count + 1 + gridDim.x);
    const int ticket = mlxserve_ticket(count);
    // A tile's blocks meet at the count after its first's ticket.
    mlxserve_fold_block<T, TX, TA, TB, D, IN, R, YW, COL, WARPS, EI, EO, TT, NT, SPLIT, EPS_BITS>(
        x, base, lx, a_t, b, idx, scale, w, count + 1 + ticket / SPLIT * SPLIT, tokens,
        ticket / SPLIT, ticket % SPLIT, h, out, zp, zw, z);
"""

SLICES = 8  # blocks a fold's tile takes, each summing z over a slice of the input
# Warps of a fold's block: the norm's sums run on add_rms_norm's THREADS threads.
FOLD_WARPS = 8


@cache
def _fold_kernel() -> Any:
    return cuda_kernel(
        name="mlxserve_add_update_rms_norm",
        input_names=["x", "base", "lx", "a_t", "b", "idx", "scale", "w", "counts"],
        output_names=["h", "out"],
        source=_FOLD_SOURCE,
        header=lora_kernel.kernel_header(_FOLD_HEADER),
    )


def foldable(x: mx.array, update: lora_kernel.Deferred, weight: mx.array) -> bool:
    """Whether `add_update_rms_norm` takes x and the update: the dtypes and width `supported`
    asks of an add, the update's output as wide as x, one of its tokens for each of x's rows,
    and `fused_add`'s kernel here."""
    part = update.part
    width = x.shape[-1]
    rows = x.size // width
    return (
        supported(x, part.base(), weight)
        and lora_kernel.available()
        and part.y.dtype == x.dtype
        and part.width == width
        and update.x.size // update.x.shape[-1] == rows == part.idx.size
    )


def add_update_rms_norm(
    x: mx.array, update: lora_kernel.Deferred, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """`add_rms_norm(x, r)` for r the deferred update's output (base + each token's LoRA update,
    `lora_kernel.fused_add`'s arithmetic but z summed over SLICES slices of the input), r made
    inside the same kernel where `foldable`; elsewhere from the update's own ops."""
    part = update.part
    if not foldable(x, update, weight):
        (r,) = lora_kernel.fused_add(update.x, [part], update.scale, update.counts)
        return add_rms_norm(x, r.reshape(x.shape), weight, eps)
    width = x.shape[-1]
    rows = x.size // width
    if rows == 0:
        return x + part.base(), mx.zeros_like(x)
    lx = update.x
    in_width = lx.shape[-1]
    rank = part.a_t.shape[1]
    threads = FOLD_WARPS * 32
    tile_count = lora_kernel.tiles(rows, part.a_t.shape[0])
    h, y = _fold_kernel()(
        inputs=[
            *(x, part.y, lx, part.a_t, part.b, part.idx, update.scale, weight),
            lora_kernel.take_counts(update.counts, fold_counts(rows, part)),
        ],
        template=[
            ("T", x.dtype),
            ("TX", lx.dtype),
            ("TA", part.a_t.dtype),
            ("TB", part.b.dtype),
            ("D", width),
            ("IN", in_width),
            ("R", rank),
            ("YW", part.y.shape[-1]),
            ("COL", part.start),
            ("WARPS", FOLD_WARPS),
            ("EI", lora_kernel.vector(in_width)),
            ("EO", lora_kernel.vector(width)),
            ("TT", lora_kernel.TILE),
            ("NT", THREADS),
            ("SPLIT", SLICES),
            ("EPS_BITS", float_bits(eps)),
        ],
        grid=(tile_count * SLICES * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return h, y


def fold_counts(rows: int, part: lora_kernel.Part) -> int:
    """The int32 words a fold of `rows` rows uses: its ticket counter, one count for each of its
    blocks (a tile's blocks meet at that of its first), then their z slices
    (`lora_kernel.workspace`)."""
    block_count = lora_kernel.tiles(rows, part.a_t.shape[0]) * SLICES
    return lora_kernel.workspace(block_count, part.a_t.shape[1])


P = TypeVar("P")


class Latest(Generic[P]):
    """What goes with one array on one thread: a weak reference to the array, and its payload
    (kept only while the array is alive, so a forward's activations are not). A later `keep`
    replaces it."""

    def __init__(self) -> None:
        self.held: tuple[weakref.ref[mx.array], P] | None = None

    def keep(self, out: mx.array, payload: P) -> None:
        self.held = (weakref.ref(out, self._drop), payload)

    def payload_of(self, x: mx.array) -> P | None:
        """The payload kept with x, if x is the array kept."""
        held = self.held
        if held is None or held[0]() is not x:
            return None
        return held[1]

    def _drop(self, ref: weakref.ref[mx.array]) -> None:
        if self.held is not None and self.held[0] is ref:
            self.held = None


class _PerThread(threading.local):
    def __init__(self) -> None:
        # The last layer's returned sum h + r, with (h, r).
        self.sum: Latest[tuple[mx.array, mx.array]] = Latest()
        # The latest deferred LoRA update's output, with its pieces.
        self.update: Latest[lora_kernel.Deferred] = Latest()


_PER_THREAD = _PerThread()


def defer(out: mx.array, update: lora_kernel.Deferred) -> None:
    """Record that `out` is `update`'s output, so that an add of it that comes next (on this
    thread, while out lives) makes the update itself (`add_rms_norm`)."""
    _PER_THREAD.update.keep(out, update)


class FusedNormBlock(nn.Module):
    """mlx-lm's llama/qwen2/qwen3 `TransformerBlock`, its adds fused with the norms after them
    (the class of such a layer is swapped to this one; see the module's docstring)."""

    input_layernorm: nn.RMSNorm
    post_attention_layernorm: nn.RMSNorm
    self_attn: nn.Module
    mlp: nn.Module

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        kept = _PER_THREAD.sum
        parts = kept.payload_of(x)
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
        kept.keep(out, (h, r))
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
