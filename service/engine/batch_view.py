"""A per-step view that lets mlx-lm's model code run a ragged batch over our storage.

mlx-lm's attention layers call `cache.update_and_fetch(keys, values)`, read
`cache.offset` for RoPE, and ask `cache.make_mask(N)` for the attention mask.
`BatchView` answers those calls for one forward of B rows, where row i has
`starts[i]` tokens cached already and `lengths[i]` new tokens (right-padded to
N). The storage writes each row's new K/V into that row's own memory and
returns the rows' K/V right-padded to the longest; the boolean mask hides the
padding. Nothing of another row is copied or touched when a row joins or leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx


class KVStorage(Protocol):
    """Where sequences' K/V live (dense per-sequence arrays, or a paged block pool)."""

    def write_and_gather(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]: ...


@dataclass
class StepLayout:
    """The shape of one forward: which sequences, where each row starts, how many new tokens."""

    handles: list[Any]  # storage-specific per-sequence handles
    starts: list[int]
    lengths: list[int]
    # Shape buckets: pad the step to at least this many new tokens per row (width) and this
    # many key positions (span); the padding is masked out. See Engine's shape_buckets.
    pad_width: int = 0
    pad_span: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.handles)

    @property
    def width(self) -> int:
        return max(max(self.lengths), self.pad_width)

    @property
    def total_lengths(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.lengths)]

    @property
    def span(self) -> int:
        """Key positions attention sees: the longest row's, or the bucket's when padded."""
        return max(max(self.total_lengths), self.pad_span)

    @property
    def padded(self) -> bool:
        return self.width > max(self.lengths) or self.span > max(self.total_lengths)


class BatchView:
    """The cache object handed to one layer of the model for one step."""

    def __init__(self, storage: KVStorage, layout: StepLayout, layer: int, shared: _StepShared):
        self._storage = storage
        self._layout = layout
        self._layer = layer
        self._shared = shared

    @property
    def offset(self) -> int | mx.array:
        return self._shared.offset

    @property
    def direct(self) -> bool:
        """True when this step's attention reads the pool directly (`attend`): then
        `update_and_fetch` returns the written pool arrays, not gathered K/V."""
        return self._shared.direct

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._shared.direct:
            return self._storage.write(self._layer, self._layout, keys, values)
        if self._shared.mirrored:
            return self._storage.write_mirrored(self._layer, self._layout, keys, values)
        return self._storage.write_and_gather(self._layer, self._layout, keys, values)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float):
        """Attention for a direct step (called through service.engine.paged_attention)."""
        return self._storage.attend(self._layer, self._layout, queries, keys, values, scale)

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by BatchView")
        return self._shared.mask

    # mlx-lm checks truthiness of the cache object before asking for a mask.
    def __bool__(self) -> bool:
        return True


class _StepShared:
    """RoPE offsets and the attention mask, computed once per step for all layers."""

    def __init__(self, layout: StepLayout, direct: bool = False, mirror: Any = None) -> None:
        b, n = layout.batch_size, layout.width
        self.direct = direct
        self.mirrored = mirror is not None
        if direct or mirror is not None:
            # Direct: attention reads each row up to its own length, no mask to build. Mirror:
            # the storage's contiguous copy, whose own mask hides the left padding of shorter
            # rows (service.engine.kv_mirror). RoPE positions are the rows' either way.
            self.offset: int | mx.array = (
                layout.starts[0] if b == 1 else mx.array(layout.starts, dtype=mx.int32)
            )
            self.mask: mx.array | str | None = mirror.mask if mirror is not None else None
            return
        if b == 1 and not layout.padded:
            # A single unpadded row: plain int offset and the fused causal mask, exactly what
            # a lone mlx-lm forward would use.
            self.offset = layout.starts[0]
            self.mask = "causal" if n > 1 else None
            return
        self.offset = mx.array(layout.starts, dtype=mx.int32)
        total = layout.span
        starts = mx.array(layout.starts)[:, None, None]
        ends = mx.array(layout.total_lengths)[:, None, None]
        query_pos = starts + mx.arange(n)[None, :, None]  # [B, N, 1]
        key_pos = mx.arange(total)[None, None, :]  # [1, 1, T]
        self.mask = ((key_pos <= query_pos) & (key_pos < ends))[:, None]  # [B, 1, N, T]


def make_views(
    storage: KVStorage, layout: StepLayout, num_layers: int, direct: bool = False
) -> list[BatchView]:
    """One view per layer; direct = attention reads the paged pool itself (decode steps).
    A decode step over storage that keeps a decode mirror reads the mirror instead."""
    mirror = None
    begin = getattr(storage, "begin_mirrored_step", None)
    if begin is not None and not direct and layout.width == 1 and not layout.padded:
        mirror = begin(layout)
    shared = _StepShared(layout, direct, mirror)
    return [BatchView(storage, layout, layer, shared) for layer in range(num_layers)]
