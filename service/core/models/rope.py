"""RoPE variants that need care when rows of one forward sit at different positions.

mlx-lm's `DynamicNTKScalingRoPE` derives its base from the sequence length (`offset` plus the
new tokens), with Python's `max` on the offset: a batched step's per-row offsets (an array)
cannot go through it, and each row needs its own base once it is past the trained context.
`RowwiseDynamicNTKRoPE` computes what a lone forward of each row would: one rotation for all
rows while every row is within the trained context (the base is then the configured one),
else one per row with that row's base. A lone forward's length is the row's own new tokens,
not the step's padded width: the engine publishes them for the step in `ROW_LENGTHS`.

Every other variant mlx-lm ships (default, linear, llama3, yarn, longrope/su, proportional)
rotates with fixed frequencies and takes per-row offsets as they are.

`DeferredRoPE` (CUDA decode steps that read the pool directly): the rotation of one new token per
row is left to the kernels that read q and k anyway, the paged attention (q) and the in-place K/V
store (k), which saves two kernels a layer. Only the fixed-frequency variants whose rotation is
`mx.fast.rope` of the input as it is (plain and llama3) are deferred; see `Rotation`.

`SharedAngleRoPE` (the CPU): every layer of a forward rotates at the same positions, yet MLX's
CPU RoPE, an unfused fallback, computes the positions, frequencies, angles and their cos and sin
again in every call: a dozen primitives each, twice a layer. The wrapper takes the cos and sin
once per forward and rotates with the fallback's own products, in its order. Both are traced
once by `mx.compile` (shapeless): on the CPU every primitive costs host work on the thread that
queues it and on the stream's thread that runs it, and the compiled chains are one primitive
each. Compiled, the same float operations round the same way (no contraction into
multiply-adds: MLX builds its CPU kernels for the baseline instruction set), so the output is
still `mx.fast.rope`'s bit for bit (tests/test_rope.py).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, Llama3RoPE

from service.core.engine.device_memory import resident
from service.core.engine.kernel_source import cuda_kernel
from service.core.models.swap import swap_modules

# The new tokens of each row of the forward being built (set by the engine around it).
ROW_LENGTHS: ContextVar[list[int] | None] = ContextVar("row_lengths", default=None)


class RowwiseDynamicNTKRoPE(nn.Module):
    def __init__(self, inner: DynamicNTKScalingRoPE) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if not isinstance(offset, mx.array):
            return self.inner(x, offset)
        inner = self.inner
        width = x.shape[-2]
        offsets = offset.tolist()  # built from host integers: no wait on the device
        lengths = ROW_LENGTHS.get() or [width] * len(offsets)
        if max(o + n for o, n in zip(offsets, lengths)) <= inner.max_position_embeddings:
            return mx.fast.rope(
                x,
                inner.dims,
                traditional=inner.traditional,
                base=inner.base,
                scale=1.0,
                offset=offset,
            )
        rows = []
        for i, (o, n) in enumerate(zip(offsets, lengths)):
            row = inner(x[i : i + 1, ..., :n, :], int(o))
            if n < width:  # padding positions: rotated or not, they are masked out
                row = mx.concatenate([row, x[i : i + 1, ..., n:, :]], axis=-2)
            rows.append(row)
        return mx.concatenate(rows, axis=0)


def reads_offsets_on_host(model: Any) -> bool:
    """Whether a RoPE module reads the rows' offsets on the host (so a step cannot be traced
    into a compiled graph, where arrays have no values)."""
    return any(isinstance(m, RowwiseDynamicNTKRoPE) for m in model.modules())


def install(model: Any) -> int:
    """Wrap the model's dynamic-NTK RoPE modules; returns how many were wrapped."""
    return swap_modules(
        model, lambda child: isinstance(child, DynamicNTKScalingRoPE), RowwiseDynamicNTKRoPE
    )


class _Angles(threading.local):
    """The cos and sin of this thread's forward, per rotation (dims, base, scale, dtype)."""

    def __init__(self) -> None:
        # rotation -> (offset (the array itself, so its id cannot be reused), shape, cos, sin)
        self.entries: dict[tuple[Any, ...], tuple[Any, tuple[int, ...], mx.array, mx.array]] = {}


_ANGLES = _Angles()


class SharedAngleRoPE(nn.Module):
    """mlx-lm's plain `nn.RoPE` (non-traditional) with its cos and sin made once per forward.

    The first layer's call computes them as the fallback does: positions (0..T-1 plus each
    row's offset, times the scale) times the inverse frequencies (the fallback's own expression,
    evaluated once here), their cos and sin in the input's dtype. Every call of the forward (the
    same offsets, rows and tokens) rotates with them by the fallback's products, so its output
    is `mx.fast.rope`'s bit for bit."""

    def __init__(self, inner: nn.RoPE) -> None:
        super().__init__()
        self.inner = inner
        half = inner.dims // 2
        # Not a parameter: the model's weights stay mlx-lm's.
        self._inv_freqs = mx.exp(
            mx.arange(0, -half, -1, dtype=mx.float32)
            * mx.array(math.log(inner.base) / half, mx.float32)
        )
        self._scale = mx.array(inner.scale, mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        inner = self.inner
        if x.ndim != 4:
            return inner(x, offset)
        cos, sin = self._angles(x, offset)
        half, dims = inner.dims // 2, inner.dims
        parts = list(_rotate(x[..., :half], x[..., half:dims], cos, sin))
        if dims < x.shape[-1]:
            parts.append(x[..., dims:])
        return mx.concatenate(parts, axis=-1)

    def _angles(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        inner = self.inner
        rotation = (inner.dims, inner.base, inner.scale, x.dtype)
        shape = (x.shape[0], x.shape[2])
        entry = _ANGLES.entries.get(rotation)
        if entry is not None and entry[1] == shape:
            held = entry[0]
            if held is offset or (
                isinstance(offset, int) and isinstance(held, int) and held == offset
            ):
                return entry[2], entry[3]
        if isinstance(offset, mx.array):  # a row's offset each, as the fallback's int32
            as_int = offset if offset.dtype == mx.int32 else offset.astype(mx.int32)
            offsets = as_int.reshape(-1, 1, 1, 1)
        else:
            offsets = mx.array([[[[offset]]]], mx.int32)
        cos, sin = _angles_in(x.dtype)(
            _positions(x.shape[2]), offsets, self._scale, self._inv_freqs
        )
        _ANGLES.entries[rotation] = (offset, shape, cos, sin)
        return cos, sin


@functools.lru_cache(maxsize=64)
def _positions(tokens: int) -> mx.array:
    """0..tokens-1 as float32 [1, 1, tokens, 1] (the fallback's arange), kept per width: once
    evaluated (by the first forward that uses it) it costs later forwards no primitive."""
    return mx.arange(tokens, dtype=mx.float32).reshape(1, 1, tokens, 1)


@functools.cache
def _angles_in(dtype: mx.Dtype) -> Callable[..., tuple[mx.array, mx.array]]:
    """The fallback's angles, cos and sin in `dtype`, traced once (shapeless) per dtype."""

    def angles(
        positions: mx.array, offsets: mx.array, scale: mx.array, inv_freqs: mx.array
    ) -> tuple[mx.array, mx.array]:
        theta = (positions + offsets) * scale * inv_freqs
        return mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)

    return mx.compile(angles, shapeless=True)


@functools.partial(mx.compile, shapeless=True)
def _rotate(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array]:
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def share_angles(model: Any, dtype: mx.Dtype | None = None) -> int:
    """Wrap the model's plain non-traditional RoPE modules (`SharedAngleRoPE`); returns how
    many were wrapped, having built their kernels for inputs of `dtype` (`warm`) if given."""
    wrapped = swap_modules(
        model, lambda child: type(child) is nn.RoPE and not child.traditional, SharedAngleRoPE
    )
    if wrapped and dtype is not None:
        warm(dtype)
    return wrapped


def warm(dtype: mx.Dtype) -> None:
    """Build the angles' and the rotation's kernels now: MLX compiles each for the CPU on first
    use (with the system's C++ compiler, about a second on a machine that has not cached it
    yet), one per layout of the inputs (one row or many, one head or many, one token or many),
    and a request should not wait for that."""
    layer = SharedAngleRoPE(nn.RoPE(8))
    for rows in (1, 2):
        for heads in (1, 2):
            for tokens in (1, 3):
                offsets = mx.arange(rows) if rows > 1 else 0
                mx.eval(layer(mx.ones((rows, heads, tokens, 8), dtype), offsets))
                _ANGLES.entries.clear()


@dataclass(eq=False)
class Rotation:
    """What `mx.fast.rope` does to a token at position p: pairs of its first `dims` dimensions
    ((i, i + dims / 2), or (2i, 2i + 1) when `traditional`) rotate by the angle
    (scale * p) * inv_freqs[i], computed in float32 as MLX's CUDA kernel does; the result is
    rounded to the input's dtype. `module` applies the same rotation through MLX. A plain
    `nn.RoPE`'s inverse frequencies come from the device's exp2 as MLX's do
    (`plain_inv_freqs`); the compilers may still contract the rotation's products into
    multiply-adds differently, so a rotated element may differ from `mx.fast.rope`'s by an ulp
    of its dtype (the tests allow one)."""

    module: nn.Module
    dims: int
    traditional: bool
    inv_freqs: mx.array  # float32 [dims / 2]
    scale: float  # the kernels' template value (device_memory)

    def apply(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return self.module(x, offset=offset)


def rotation_of(module: Any) -> Rotation | None:
    """The rotation of a RoPE module whose call is `mx.fast.rope(x, ...)` with fixed
    frequencies (mlx-lm's plain `nn.RoPE` and `Llama3RoPE`); None for any other."""
    if type(module) is nn.RoPE:
        inv_freqs = plain_inv_freqs(module.dims // 2, module.base)
        scale = module.scale
    elif type(module) is Llama3RoPE:
        # MLX's kernel with frequencies: inv_freq = 1.0 / freqs[i] (a double division).
        inv = (1.0 / np.array(module._freqs, dtype=np.float64)).astype(np.float32)
        inv_freqs = resident(inv)
        scale = 1.0
    else:
        return None
    return Rotation(
        module=module,
        dims=module.dims,
        traditional=module.traditional,
        inv_freqs=inv_freqs,
        scale=float(scale),
    )


# MLX's CUDA RoPE kernel's own expression (rope.cu): d = i / half, inv_freq = exp2(-d * log2 base),
# with log2(base) computed on the host and passed as a float.
_INV_FREQS_SOURCE = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < HALF) {
        const float d = static_cast<float>(i) / static_cast<float>(HALF);
        inv_freqs[i] = exp2(-d * log2_base[0]);
    }
"""


@functools.cache
def _inv_freqs_kernel() -> Any:
    return cuda_kernel(
        name="mlxserve_rope_inv_freqs",
        input_names=["log2_base"],
        output_names=["inv_freqs"],
        source=_INV_FREQS_SOURCE,
    )


def plain_inv_freqs(half: int, base: float) -> mx.array:
    """A plain RoPE's inverse frequencies (float32 [half]) as MLX's RoPE computes them: on CUDA
    by the device's exp2, as its kernel does (the host's exp2 can round another way); elsewhere
    on the host."""
    log2_base = np.float32(math.log2(base))
    if not mx.cuda.is_available():
        d = np.arange(half, dtype=np.float32) / np.float32(half)
        return mx.array(np.exp2(-d * log2_base).astype(np.float32))
    threads = min(256, half)
    (inv_freqs,) = _inv_freqs_kernel()(
        inputs=[mx.array([float(log2_base)], dtype=mx.float32)],
        template=[("HALF", half)],
        grid=(-(-half // threads) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(half,)],
        output_dtypes=[mx.float32],
    )
    mx.eval(inv_freqs)
    return inv_freqs


class _Deferral(threading.local):
    """This thread's direct decode step: its offsets array (what marks a RoPE call as one of
    its calls) and the rotations deferred, each with the array it returned unrotated."""

    def __init__(self) -> None:
        self.offset: mx.array | None = None
        self.held: list[tuple[mx.array, Rotation]] = []


_DEFERRAL = _Deferral()


def begin_step(offset: mx.array | None) -> None:
    """A forward is being built: RoPE calls with this offsets array (a direct decode step's,
    one token a row) defer their rotation; None: this forward's calls rotate as usual. What an
    earlier forward cut short (an error while it was built) left deferred is dropped."""
    _DEFERRAL.offset = offset
    _DEFERRAL.held = []


def take(x: mx.array) -> Rotation | None:
    """The rotation deferred for x (a direct step's queries or keys, as the RoPE call returned
    them), now the caller's to apply; None: x was not deferred (rotated already, or never)."""
    held = _DEFERRAL.held
    for i, (array, rotation) in enumerate(held):
        if array is x:
            del held[i]
            return rotation
    return None


def settle() -> None:
    """A layer's attention is done: every rotation it deferred has been taken. One left over
    means the model changed q or k between RoPE and the cache, and the rotation was lost."""
    if _DEFERRAL.held:
        count = len(_DEFERRAL.held)
        _DEFERRAL.held = []
        raise RuntimeError(
            f"{count} deferred RoPE rotation(s) not applied: the model transforms q or k between "
            "RoPE and attention, which folding RoPE into the decode kernels cannot serve"
        )


class DeferredRoPE(nn.Module):
    """A RoPE module that, in a direct decode step, returns its input unrotated and leaves the
    rotation to the kernels (`take`); every other call rotates as the module does."""

    def __init__(self, inner: nn.Module, rotation: Rotation) -> None:
        super().__init__()
        self.inner = inner
        self._rotation = rotation

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        step = _DEFERRAL.offset
        if step is not None and offset is step and x.shape[-2] == 1:
            _DEFERRAL.held.append((x, self._rotation))
            return x
        return self.inner(x, offset)


def defer(model: Any) -> int:
    """Wrap the model's RoPE modules whose rotation the decode kernels can apply
    (`rotation_of`); returns how many were wrapped."""
    return swap_modules(
        model,
        lambda child: rotation_of(child) is not None,
        lambda child: DeferredRoPE(child, _rotation(child)),
    )


def _rotation(module: Any) -> Rotation:
    rotation = rotation_of(module)
    assert rotation is not None
    return rotation
