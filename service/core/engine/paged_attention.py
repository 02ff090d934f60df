"""Decode attention read straight from the paged KV pool, without gathering it first.

A decode step whose rows have different lengths needs a mask over the padded keys of a gathered
`[B, kv_heads, T, head_dim]` K/V. MLX's fused CUDA attention (sdpa_vector) takes no array mask,
so such a step falls back to unfused ops (matmul, mask, softmax, matmul) in every layer, after
two gathers that copy every row's K/V. `paged_decode_attention` instead reads each row's keys
through its slot list and stops at the row's own length: one kernel per layer, no mask, no copy.
On CUDA it is a custom kernel; elsewhere a reference built from MLX ops (gather, mask, fused
attention), which is what tests on the CPU exercise.

mlx-lm's llama-family attention calls its module's `scaled_dot_product_attention(queries, keys,
values, cache=..., scale=..., mask=...)`. `install` wraps that function once per module so that a
step whose cache view is `direct` (the view wrote the new K/V into the pool and returned the pool
itself) is answered here; every other call goes to mlx-lm's function unchanged.

`store_decode_kv` writes a decode step's new K/V into the pool in place (CUDA only). MLX's own
scatter is functional: it reuses the pool's buffer only when nothing else references it, so a
step queued while the previous one still reads the pool would copy every layer's pool. Writing
in place lets the scheduler queue step N+1 before step N's tokens are read (the engine's
overlap_steps): one CUDA stream runs the steps in order, so N's attention has read the pool
before N+1's write lands, and each attention takes its layer's write as an input, so it runs
after it.

On the CUDA decode path the attention kernel does that write itself (`store=`): one block per
K/V head writes the new K/V, and every block reads each row's newest position from the new
K/V rather than from the pool, so no block reads a slot while another writes it, and the layer
launches one kernel instead of two. `store_decode_kv` remains for a layer whose keys' RoPE is
not its queries'.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx

from service.core.engine.device_memory import float_bits
from service.core.engine.kernel_source import cuda_kernel
from service.core.models.rope import Rotation

WARPS = 16  # warps per (row, head): each takes every WARPS-th key, then they merge

# RoPE of one element, for the kernels that take a decode step's rotation (service.core.models.
# rope.Rotation): MLX's CUDA RoPE kernel's arithmetic (to an ulp: see Rotation), the pair's
# other element read by the caller. ROPE_DIMS 0: no rotation.
_ROPE_HEADER = """
template <int ROPE_DIMS, int TRADITIONAL>
__device__ __forceinline__ int mlxserve_rope_partner(int d) {
    if (TRADITIONAL) {
        return d % 2 == 0 ? d + 1 : d - 1;
    }
    return d < ROPE_DIMS / 2 ? d + ROPE_DIMS / 2 : d - ROPE_DIMS / 2;
}

// Element d (< ROPE_DIMS) of a token at position `pos` after rotation: x is its value, other
// its pair's. A pair (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos).
template <int ROPE_DIMS, int TRADITIONAL>
__device__ __forceinline__ float mlxserve_rotate(
    int d, float x, float other, int pos, const float* inv_freqs, float scale) {
    const bool first = TRADITIONAL ? d % 2 == 0 : d < ROPE_DIMS / 2;
    const int i = TRADITIONAL ? d / 2 : (first ? d : d - ROPE_DIMS / 2);
    const float theta = (scale * static_cast<float>(pos)) * inv_freqs[i];
    const float c = cos(theta);
    const float s = sin(theta);
    return first ? x * c - other * s : other * s + x * c;
}

// Element d of a head vector read at x[at + j * stride] (j: its dimension), as float: rotated
// for a token at position `pos` when d < ROPE_DIMS, and then rounded to R as MLX's RoPE kernel
// rounds its output.
template <int ROPE_DIMS, int TRADITIONAL, typename R, typename X>
__device__ __forceinline__ float mlxserve_rotated(
    const X* x, int64_t at, int64_t stride, int d, int pos, const float* inv_freqs, float scale) {
    const float v = static_cast<float>(x[at + d * stride]);
    if (d >= ROPE_DIMS) {
        return v;
    }
    const int partner = mlxserve_rope_partner<ROPE_DIMS, TRADITIONAL>(d);
    return static_cast<float>(static_cast<R>(mlxserve_rotate<ROPE_DIMS, TRADITIONAL>(
        d, v, static_cast<float>(x[at + partner * stride]), pos, inv_freqs, scale)));
}
"""

_SOURCE = """
    // One block of WARPS warps per (row, query head). Warp w scores keys w, w+WARPS, ...;
    // lane l holds dimensions [l*PER, (l+1)*PER) of the head. Online softmax per warp, then
    // the warps merge through shared memory. q, slots and lengths are read through their
    // strides (the kernel is made with ensure_row_contiguous=False): a strided input would
    // otherwise be copied in every layer. The pools are the storage's own, contiguous.
    constexpr int PER = D / 32;
    const float NEG_INF = __int_as_float(0xff800000);
    const int bh = blockIdx.x;
    const int b = bh / HEADS;
    const int h = bh % HEADS;
    const int kvh = h / (HEADS / KV_HEADS);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int length = lengths[b * lengths_strides[0]];
    // WINDOW 0: full attention; else the last WINDOW positions. The constants are template
    // values, not arrays: see device_memory.
    const int first = (WINDOW > 0 && length > WINDOW) ? length - WINDOW : 0;
    const float scale = __int_as_float(SCALE_BITS);

    // The query (its deferred RoPE applied: position length - 1) and, with STORE, this
    // step's new K/V ([B, KV_HEADS, 1, D], read through their strides) are the same for every
    // warp: one warp rotates each (precise sin and cos, as MLX's RoPE kernel) into shared
    // memory, and every warp reads them from there. The key is rounded as the store kernel
    // would have written it.
    __shared__ float q_shared[D];
    __shared__ float k_shared[D];
    __shared__ float v_shared[D];
    if (warp == 0) {
        const int64_t q_at = b * q_strides[0] + h * q_strides[1];
        for (int i = 0; i < PER; ++i) {
            const int d = lane * PER + i;
            q_shared[d] = scale * mlxserve_rotated<ROPE_DIMS, TRADITIONAL, T>(
                q, q_at, q_strides[3], d, length - 1, inv_freqs, __int_as_float(ROPE_SCALE_BITS));
        }
    }
    if (STORE && warp == (WARPS > 1 ? 1 : 0)) {
        const int64_t kn_at = b * k_new_strides[0] + kvh * k_new_strides[1];
        const int64_t vn_at = b * v_new_strides[0] + kvh * v_new_strides[1];
        for (int i = 0; i < PER; ++i) {
            const int d = lane * PER + i;
            const float k = mlxserve_rotated<ROPE_DIMS, TRADITIONAL, K>(k_new, kn_at,
                k_new_strides[3], d, length - 1, inv_freqs, __int_as_float(ROPE_SCALE_BITS));
            k_shared[d] = static_cast<float>(static_cast<P>(k));
            v_shared[d] = static_cast<float>(static_cast<P>(v_new[vn_at + d * v_new_strides[3]]));
        }
    }
    __syncthreads();
    float qv[PER];
    float acc[PER];
    float new_k[PER];
    float new_v[PER];
    for (int i = 0; i < PER; ++i) {
        qv[i] = q_shared[lane * PER + i];
        acc[i] = 0.0f;
        new_k[i] = STORE ? k_shared[lane * PER + i] : 0.0f;
        new_v[i] = STORE ? v_shared[lane * PER + i] : 0.0f;
    }
    // STORE: the new K/V go into the pools here, in place, by the first query head of each
    // KV head; every block reads the row's newest position (length - 1) from them, not from
    // the pool, so no block reads a slot while it is written.
    if (STORE && h % (HEADS / KV_HEADS) == 0) {
        const size_t dst = ((size_t)write[b * write_strides[0]] * KV_HEADS + kvh) * D;
        for (int d = threadIdx.x; d < D; d += WARPS * 32) {
            const_cast<P*>(k_pool)[dst + d] = static_cast<P>(k_shared[d]);
            const_cast<P*>(v_pool)[dst + d] = static_cast<P>(v_shared[d]);
        }
    }
    float m = NEG_INF;
    float s = 0.0f;
    for (int t = first + warp; t < length; t += WARPS) {
        const bool newest = STORE && t == length - 1;
        const size_t slot =
            (size_t)slots[b * slots_strides[0] + (t / BLOCK) * slots_strides[1]] * BLOCK
            + t % BLOCK;
        const size_t base = (slot * KV_HEADS + kvh) * D + lane * PER;
        float dot = 0.0f;
        for (int i = 0; i < PER; ++i) {
            dot += qv[i] * (newest ? new_k[i] : static_cast<float>(k_pool[base + i]));
        }
        for (int offset = 16; offset > 0; offset /= 2) {
            dot += __shfl_xor_sync(0xffffffff, dot, offset);
        }
        const float m_new = fmaxf(m, dot);
        const float correction = __expf(m - m_new);
        const float p = __expf(dot - m_new);
        s = s * correction + p;
        for (int i = 0; i < PER; ++i) {
            const float v = newest ? new_v[i] : static_cast<float>(v_pool[base + i]);
            acc[i] = acc[i] * correction + p * v;
        }
        m = m_new;
    }

    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float warp_acc[WARPS][D];
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = s;
    }
    for (int i = 0; i < PER; ++i) {
        warp_acc[warp][lane * PER + i] = acc[i];
    }
    __syncthreads();
    if (warp == 0) {
        float total_max = NEG_INF;
        for (int w = 0; w < WARPS; ++w) {
            total_max = fmaxf(total_max, warp_max[w]);
        }
        float total = 0.0f;
        float out_v[PER];
        for (int i = 0; i < PER; ++i) {
            out_v[i] = 0.0f;
        }
        for (int w = 0; w < WARPS; ++w) {
            const float c = warp_max[w] == NEG_INF ? 0.0f : __expf(warp_max[w] - total_max);
            total += warp_sum[w] * c;
            for (int i = 0; i < PER; ++i) {
                out_v[i] += warp_acc[w][lane * PER + i] * c;
            }
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int i = 0; i < PER; ++i) {
            out[(size_t)bh * D + lane * PER + i] = static_cast<T>(out_v[i] * inv);
        }
    }
"""


def kernel_available() -> bool:
    """The custom kernel runs on MLX's CUDA backend only."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


@cache
def _kernel() -> Any:
    return cuda_kernel(
        name="mlxserve_paged_decode_attention",
        # `after`: the layer's in-place K/V write (or any array): only orders the kernels.
        input_names=[
            "q",
            "k_pool",
            "v_pool",
            "slots",
            "lengths",
            "inv_freqs",
            "k_new",
            "v_new",
            "write",
            "after",
        ],
        output_names=["out"],
        source=_SOURCE,
        header=_ROPE_HEADER,
        ensure_row_contiguous=False,
    )


@cache
def _no_rotation() -> mx.array:
    return mx.zeros((1,), dtype=mx.float32)  # never read: ROPE_DIMS is 0


def _rope_inputs(rotation: Rotation | None) -> list[mx.array]:
    """`inv_freqs` of the kernels that apply a deferred RoPE."""
    return [_no_rotation() if rotation is None else rotation.inv_freqs]


def _rope_template(rotation: Rotation | None) -> list[tuple[str, int]]:
    if rotation is None:
        return [("ROPE_DIMS", 0), ("TRADITIONAL", 0), ("ROPE_SCALE_BITS", 0)]
    return [
        ("ROPE_DIMS", rotation.dims),
        ("TRADITIONAL", int(rotation.traditional)),
        ("ROPE_SCALE_BITS", float_bits(rotation.scale)),
    ]


def paged_decode_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    slots: mx.array,
    lengths: mx.array,
    scale: float,
    after: mx.array | None = None,
    window: int | None = None,
    block: int = 1,
    rotation: Rotation | None = None,
    store: NewKV | None = None,
) -> mx.array:
    """Attention of one new token per row over that row's first `lengths[b]` positions, or
    its last `window` of them. `rotation`: the queries' RoPE, deferred to here (each row's
    token at position lengths[b] - 1).

    queries [B, heads, 1, head_dim]; k_pool/v_pool [slots, kv_heads, head_dim]; slots [B, T]
    int32, the pool slot of each position (entries past a row's length are ignored), or with
    `block` > 1 [B, T / block] the block of each `block` positions (position t is slot
    slots[b, t // block] * block + t % block); lengths [B] int32; after: `store_decode_kv`'s
    result when the step wrote the pool in place (the kernel then runs after the write);
    store: the step's new K/V, written into the pools in place by this kernel instead (CUDA
    only; their keys' RoPE, deferred, is `rotation` too). Returns [B, heads, 1, head_dim]."""
    b, heads, n, head_dim = queries.shape
    kv_heads = k_pool.shape[1]
    if n != 1:
        raise ValueError(f"paged decode attention takes one query per row, got {n}")
    if not (kernel_available() and kernel_supports(head_dim)):
        if store is not None:
            raise RuntimeError("in-place K/V writes need MLX's CUDA backend")
        if block > 1:
            offsets = mx.arange(block, dtype=slots.dtype)
            slots = (slots[:, :, None] * block + offsets).reshape(b, -1)
        if rotation is not None:
            queries = rotation.apply(queries, lengths - 1)
        return _reference(queries, k_pool, v_pool, slots, lengths, scale, window)
    new = [store.keys, store.values, store.slots] if store is not None else [lengths] * 3
    (out,) = _kernel()(
        inputs=[
            queries,
            k_pool,
            v_pool,
            slots,
            lengths,
            *_rope_inputs(rotation),
            *new,
            after if after is not None else lengths,
        ],
        template=[
            ("T", queries.dtype),
            ("P", k_pool.dtype),
            ("K", new[0].dtype),
            ("D", head_dim),
            ("HEADS", heads),
            ("KV_HEADS", kv_heads),
            ("WARPS", WARPS),
            ("BLOCK", block),
            ("WINDOW", window or 0),
            ("SCALE_BITS", float_bits(scale)),
            ("STORE", int(store is not None)),
            *_rope_template(rotation),
        ],
        grid=(b * heads * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )
    return out


@dataclass(frozen=True)
class NewKV:
    """A direct decode step's new K/V for one layer ([B, kv_heads, 1, head_dim] each) and
    each row's pool slot for them ([B] int32), left for the attention kernel to write."""

    keys: mx.array
    values: mx.array
    slots: mx.array


_STORE_SOURCE = """
    // One thread per element of the new K and V ([tokens, KV_HEADS, 1, D], read through
    // their strides: v is a view of the fused q/k/v product, which ensure_row_contiguous would
    // copy in every layer). A key's position is its row's length - 1. The pools arrive as
    // const inputs and are written anyway: this IS the in-place update.
    const size_t per_token = (size_t)KV_HEADS * D;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)slots_shape[0] * per_token) {
        return;
    }
    const int64_t b = i / per_token;
    const int64_t h = (i % per_token) / D;
    const int64_t d = i % D;
    const size_t dst = (size_t)slots[b * slots_strides[0]] * per_token + i % per_token;
    const int64_t k_at = b * k_new_strides[0] + h * k_new_strides[1];
    // The key's deferred RoPE, rounded to k's dtype as MLX's RoPE is.
    const float k = mlxserve_rotated<ROPE_DIMS, TRADITIONAL, K>(k_new, k_at, k_new_strides[3],
        static_cast<int>(d), lengths[b * lengths_strides[0]] - 1, inv_freqs,
        __int_as_float(ROPE_SCALE_BITS));
    const_cast<P*>(k_pool)[dst] = static_cast<P>(k);
    const_cast<P*>(v_pool)[dst] =
        static_cast<P>(v_new[b * v_new_strides[0] + h * v_new_strides[1] + d * v_new_strides[3]]);
    if (i == 0) {
        done[0] = 1;
    }
"""


@cache
def _store_kernel() -> Any:
    return cuda_kernel(
        name="mlxserve_store_decode_kv",
        input_names=[
            "k_pool",
            "v_pool",
            "k_new",
            "v_new",
            "slots",
            "lengths",
            "inv_freqs",
        ],
        output_names=["done"],
        source=_STORE_SOURCE,
        header=_ROPE_HEADER,
        ensure_row_contiguous=False,
    )


def store_decode_kv(
    k_pool: mx.array,
    v_pool: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    lengths: mx.array,
    rotation: Rotation | None = None,
) -> mx.array:
    """Write one new token per row into the pools, in place (CUDA only).

    k_pool/v_pool [slots, kv_heads, head_dim]; keys/values [B, kv_heads, 1, head_dim]; slots
    [B] int32, each row's pool slot; lengths [B] int32, each row's length with its new token
    (which sits at position length - 1); rotation: the keys' RoPE, deferred to here. Returns a
    [1] array that stands for the write: pass it as `after` to every kernel that must read the
    written pool. The pools' array objects are not replaced, so nothing but stream order and
    `after` tells MLX about the write: only kernels queued after this one on the same stream
    may read the pool."""
    if not kernel_available():
        raise RuntimeError("in-place K/V writes need MLX's CUDA backend")
    b, kv_heads, n, head_dim = keys.shape
    if n != 1 or slots.shape != (b,):
        raise ValueError(f"in-place writes take one token per row, got {keys.shape}")
    size = b * kv_heads * head_dim
    (done,) = _store_kernel()(
        inputs=[k_pool, v_pool, keys, values, slots, lengths, *_rope_inputs(rotation)],
        template=[
            ("P", k_pool.dtype),
            ("K", keys.dtype),
            ("KV_HEADS", kv_heads),
            ("D", head_dim),
            *_rope_template(rotation),
        ],
        grid=(size, 1, 1),
        threadgroup=(min(256, size), 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )
    return done


def kernel_supports(head_dim: int) -> bool:
    return head_dim % 32 == 0 and head_dim <= 256


def _reference(queries, k_pool, v_pool, slots, lengths, scale, window=None) -> mx.array:
    """The same attention from MLX ops: gather the rows' K/V, mask past each length (and
    before each row's window)."""
    head_dim = k_pool.shape[2]
    kv_heads = k_pool.shape[1]
    rows = slots[:, None, :] * kv_heads + mx.arange(kv_heads)[None, :, None]  # [B, kvh, T]
    keys = mx.take(k_pool.reshape(-1, head_dim), rows, axis=0)
    values = mx.take(v_pool.reshape(-1, head_dim), rows, axis=0)
    positions = mx.arange(slots.shape[1])[None, :]
    mask = positions < lengths[:, None]
    if window is not None:
        mask = mask & (positions >= lengths[:, None] - window)
    mask = mask[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def install(model: Any) -> bool:
    """Route the model's attention calls through `_dispatch` (once per module). False when the
    module has no such function; which families call it the way `_dispatch` expects is
    service.core.models.families' `direct_decode`."""
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return False
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        return False
    if not getattr(original, "_mlxserve_dispatch", False):
        module.scaled_dot_product_attention = _dispatcher(original)
    return True


def _dispatcher(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is None and getattr(cache, "direct", False):
            return cache.attend(queries, keys, values, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attention._mlxserve_dispatch = True  # type: ignore[attr-defined]
    return attention
