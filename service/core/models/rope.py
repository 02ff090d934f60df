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
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

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
    wrapped = 0
    for module in model.modules():
        for name, child in list(module.items()):
            if isinstance(child, DynamicNTKScalingRoPE):
                module[name] = RowwiseDynamicNTKRoPE(child)
                wrapped += 1
    return wrapped
