"""Per-step views that let mlx-lm's model code run a ragged batch over our storage.

mlx-lm's attention layers call `cache.update_and_fetch(keys, values)`, read `cache.offset` for
RoPE, and ask `cache.make_mask(N, window_size=...)` for the attention mask; recurrent layers
read and assign `cache[i]`. For one forward of B rows, where row i has `starts[i]` tokens
cached already and `lengths[i]` new tokens (right-padded to N), `make_views` builds one view
per entry of the model's cache list (service.core.models.layout):

- `AttentionView`: the storage writes each row's new K/V into that row's own memory and
  returns the rows' K/V right-padded to the longest; the boolean mask hides the padding and,
  for a sliding-window layer, the positions older than its window. Rows that all start at 0
  get their own new K/V back and a lone prompt's causal mask.
- `StateView` (service.core.engine.state_store): the rows' recurrent state, stacked.
- `ListView`: a layer with several caches (`CacheList`).

Nothing of another row is copied or touched when a row joins or leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask

from service.core.engine.state_store import StateView, StepStates
from service.core.models import rope
from service.core.models.layout import AttentionEntry, CacheLayout, ListEntry, StateEntry


@dataclass
class StepLayout:
    """The shape of one forward: which rows, where each starts, how many new tokens. Arrays
    over the rows, so a step of any size is described with a few array operations."""

    handles: list[Any]  # storage-specific per-sequence handles
    starts: np.ndarray  # int32 [B] tokens cached before this forward
    lengths: np.ndarray  # int32 [B] new tokens
    # Paged storage: the rows' block tables (from the scheduler's KVCacheManager), [B, nb],
    # and how many entries of each are real.
    block_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    table_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # the runner's slots
    # Shape buckets: pad the step to at least this many new tokens per row (width) and this
    # many key positions (span); the padding is masked out. See the runner's shape_buckets.
    pad_width: int = 0
    pad_span: int = 0
    # The last `padding_rows` rows repeat the row before them to round the batch up to a shape
    # built at start: they read what it reads and write only the scratch slot.
    padding_rows: int = 0

    def padded_rows(self, n: int) -> StepLayout:
        """This layout with `n` padding rows, copies of its last row."""

        def repeat(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.repeat(a[-1:], n, axis=0)]) if len(a) else a

        return StepLayout(
            self.handles + [self.handles[-1]] * n,
            repeat(self.starts),
            repeat(self.lengths),
            repeat(self.block_table),
            repeat(self.table_lengths),
            repeat(self.rows),
            self.pad_width,
            self.pad_span,
            self.padding_rows + n,
        )

    @property
    def batch_size(self) -> int:
        return len(self.handles)

    @property
    def width(self) -> int:
        return max(int(self.lengths.max()), self.pad_width)

    @property
    def total_lengths(self) -> np.ndarray:
        return self.starts + self.lengths

    @property
    def span(self) -> int:
        """Key positions attention sees: the longest row's, or the bucket's when padded."""
        return max(int(self.total_lengths.max()), self.pad_span)

    @property
    def padded(self) -> bool:
        return self.width > int(self.lengths.max()) or self.span > int(self.total_lengths.max())


class AttentionView:
    """The cache object handed to one attention layer of the model for one step."""

    def __init__(
        self, storage: Any, layout: StepLayout, entry: AttentionEntry, shared: _StepShared
    ) -> None:
        self._storage = storage
        self._layout = layout
        self._layer = entry.pool_layer
        self._window = entry.window
        self._shared = shared

    @property
    def offset(self) -> int | mx.array:
        return self._shared.offset

    @property
    def direct(self) -> bool:
        """True when this view computes the step's attention itself (`attend`): a direct step
        (`update_and_fetch` then returns the written pool arrays, not gathered K/V) or a
        mirrored one whose storage attends over the mirror."""
        return self._shared.attends

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        mode = self._shared.mode
        if mode == "direct":
            rotation = rope.take(keys)  # deferred by the layer's RoPE: the write applies it
            return self._storage.write(
                self._layer, self._layout, keys, values, rotation, self.offset
            )
        if mode == "fresh":
            return self._storage.write_fresh(self._layer, self._layout, keys, values)
        if mode == "mirror":
            return self._storage.write_mirrored(self._layer, self._layout, keys, values)
        return self._storage.write_and_gather(self._layer, self._layout, keys, values)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float):
        """The step's attention, for a view that says `direct` (called through
        service.core.engine.paged_attention)."""
        if self._shared.mode == "mirror":
            return self._storage.attend_mirrored(queries, keys, values, scale)
        rotation = rope.take(queries)
        rope.settle()
        return self._storage.attend(
            self._layer, self._layout, queries, keys, values, scale, self._window, rotation
        )

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        return self._shared.mask(return_array, window_size)

    # mlx-lm checks truthiness of the cache object before asking for a mask.
    def __bool__(self) -> bool:
        return True


class ListView:
    """A layer with several caches (mlx-lm's `CacheList`)."""

    def __init__(self, children: list[Any]) -> None:
        self._children = children

    def __getitem__(self, index: int) -> Any:
        return self._children[index]

    def __bool__(self) -> bool:
        return True


class _StepShared:
    """RoPE offsets and attention masks, computed once per step for all layers."""

    def __init__(
        self,
        layout: StepLayout,
        mode: str,
        mirror_mask: mx.array | None,
        grouped: bool,
        mirror_attends: bool = False,
        defer_rope: bool = False,
    ) -> None:
        self.mode = mode  # "gather", "direct", "mirror" or "fresh"
        self.attends = mode == "direct" or (mode == "mirror" and mirror_attends)
        self._layout = layout
        self._grouped = grouped
        self._mirror_mask = mirror_mask
        self._masks: dict[tuple[bool, int | None], mx.array | str | None] = {}
        b = layout.batch_size
        # A single unpadded gathering row is exactly a lone mlx-lm forward: int offset, and
        # the masks mlx-lm's own KVCache would give.
        self.single = b == 1 and not layout.padded and mode == "gather"
        if b == 1 and mode != "gather":
            self.offset: int | mx.array = int(layout.starts[0])
        elif self.single:
            self.offset = int(layout.starts[0])
        else:
            self.offset = mx.array(layout.starts.astype(np.int32))
        if defer_rope:
            # The layers' RoPE calls recognize this step by its offsets array.
            if not isinstance(self.offset, mx.array):
                self.offset = mx.array(layout.starts.astype(np.int32))
            rope.begin_step(self.offset)
        else:
            rope.begin_step(None)

    def mask(self, return_array: bool, window: int | None) -> mx.array | str | None:
        key = (return_array, window)
        if key not in self._masks:
            self._masks[key] = self._make_mask(return_array, window)
        return self._masks[key]

    def _make_mask(self, return_array: bool, window: int | None) -> mx.array | str | None:
        layout = self._layout
        n = layout.width
        if self.mode == "direct":
            return None  # attention stops at each row's length and window (the kernel)
        if self.mode == "mirror":  # left padding of shorter rows; no window (see EngineConfig)
            mask = self._mirror_mask
            return mask[:, None] if self._grouped and mask is not None else mask
        if self.single or self.mode == "fresh":
            # A lone row, or rows that all start at position 0 and attend over their own
            # tokens: the mask mlx-lm's own cache gives a lone forward, one for every row.
            # A row's right padding comes after its tokens, where no query of its own looks.
            start = int(layout.starts[0])
            if window is not None or (return_array and n > 1):
                return create_causal_mask(n, start, window_size=window)
            return "causal" if n > 1 else None
        starts = mx.array(layout.starts)[:, None, None]
        ends = mx.array(layout.total_lengths)[:, None, None]
        query_pos = starts + mx.arange(n)[None, :, None]  # [B, N, 1]
        key_pos = mx.arange(layout.span)[None, None, :]  # [1, 1, T]
        mask = (key_pos <= query_pos) & (key_pos < ends)
        if window is not None:
            mask = mask & (key_pos > query_pos - window)
        return mask[:, None, None] if self._grouped else mask[:, None]  # [B, (1,) 1, N, T]


def make_views(
    storage: Any,
    cache: CacheLayout,
    layout: StepLayout,
    states: StepStates | None = None,
    mode: str = "gather",
    mirror_mask: mx.array | None = None,
    grouped_mask: bool = False,
    mirror_attends: bool = False,
    defer_rope: bool = False,
) -> list[Any]:
    """One view per entry of the model's cache list. `mode`: "gather" (K/V gathered from the
    storage, masked), "direct" (decode attention reads the paged pool itself), "mirror"
    (decode attention over the storage's contiguous copy; `mirror_mask` hides left padding),
    or "fresh" (rows that all start at 0 attend over their own new K/V, causally).
    `grouped_mask`: batched masks get a heads-repeat axis (service.core.models.families);
    `mirror_attends`: a mirrored step's attention is the storage's (`attend_mirrored`);
    `defer_rope`: a direct step's RoPE is left to the storage's `write` and `attend`
    (service.core.models.rope.DeferredRoPE)."""
    shared = _StepShared(layout, mode, mirror_mask, grouped_mask, mirror_attends, defer_rope)

    def view(entry: AttentionEntry | StateEntry) -> Any:
        if isinstance(entry, AttentionEntry):
            return AttentionView(storage, layout, entry, shared)
        if states is None:
            raise ValueError("a stateful model's step needs its rows' states")
        return StateView(states, entry.state_layer)

    out: list[Any] = []
    for entry in cache.entries:
        if isinstance(entry, ListEntry):
            out.append(ListView([view(c) for c in entry.children]))
        else:
            out.append(view(entry))
    return out
