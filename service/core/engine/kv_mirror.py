"""A contiguous copy of the decoding rows' K/V that decode attention reads in place (CPU).

A gathering decode step copies every row's K/V out of the paged pool for every layer, which on
the CPU costs about as much as the attention itself; attention over views of one contiguous
array avoids it (`bench/cpu_mirror.py` measures the two through the scheduler).

The mirror keeps, per layer, one K and one V array of `rows x kv_heads x columns` vectors
(`[rows * kv_heads * columns, head_dim]`, viewed as `[rows, kv_heads, columns, head_dim]`).
Mirror row i holds one sequence's positions left-aligned: position p at column p. A decode
step runs its rows in the mirror's order (`order_rows`: a row stays where the mirror holds it,
newcomers take the rows left free), so attention reads `[:B, :, :span]`, a view, under a mask
that hides each row's columns past its own position. Each step writes its new K/V with one
scatter per array (column = each row's position).

The paged pool stays the source of truth (every step still writes it). A row is copied in
from the pool (one take and one scatter per array, for all such rows of the step) when the
mirror does not hold its positions up to this step: it joined, moved, or ran a forward that
did not go through the mirror (its prefill, a verification). So a batch whose rows come and go
every step (closed-loop serving at many rows) copies only the rows that changed. The arrays
are reallocated, every row then copied in, only when the batch outgrows their rows or its
longest row their columns, or falls to a quarter of their rows (memory back after a burst);
they are freed when no row they hold is live or the batch falls to one row (a lone row gathers
only itself, which costs less than keeping a copy).

In float32, for a family whose attention is mlx-lm's `scaled_dot_product_attention`, the step's
attention over those views is `attend` (the engine config's `fast_mirror_attention`), whose
softmax takes the multiply-add exp.

The CPU decode path (service.core.engine.config) for models without sliding windows. The copies
are left lazy: the step's own appends and attention consume them, so the host never waits
here for the step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from service.core.engine.batch_view import StepLayout
from service.core.models.activations import fast_exp

HEADROOM = 128  # columns allocated past the longest row at each allocation
COLUMN_ROUND = 64


def slot_head_rows(slot_table: np.ndarray, kv_heads: int) -> mx.array:
    """[B, T] pool slots -> [B, kv_heads, T] rows of the pool viewed as [slots * kv_heads,
    head_dim] (slot * kv_heads + head): one take then yields [B, kv_heads, T, head_dim]."""
    heads = np.arange(kv_heads, dtype=np.int32)[None, :, None]
    return mx.array(slot_table[:, None, :] * kv_heads + heads)


class MirrorSource(Protocol):
    """What the mirror needs from the paged storage."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    def slots_of(self, table: np.ndarray, ends: np.ndarray, span: int) -> np.ndarray: ...


@dataclass
class MirrorStep:
    """What one mirrored decode step writes and attends with (the same for every layer)."""

    batch: int
    span: int  # columns attention reads: the longest row's positions, this step's included
    write: mx.array  # [B * kv_heads] mirror vectors of the rows' new K/V
    mask: mx.array | None  # [B, 1, 1, span], None when every row is at the same position
    # Rows copied in from the pool: their mirror vectors and the pool rows they copy.
    fill_to: mx.array | None = None
    fill_from: mx.array | None = None


@dataclass
class DecodeMirror:
    max_bytes: int
    kv_heads: int = 0
    head_dim: int = 0
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # slot per row
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions per row
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # handle per row
    handles: dict[int, int] = field(default_factory=dict)  # id(storage handle) -> its row
    row_capacity: int = 0
    columns: int = 0
    keys: list[mx.array] = field(default_factory=list)
    values: list[mx.array] = field(default_factory=list)
    allocations: int = 0
    copied_rows: int = 0  # rows copied in from the pool, allocations included
    step: MirrorStep | None = None

    def order_rows(self, slots: np.ndarray) -> np.ndarray:
        """A decode step's slots in the mirror's order: a slot the mirror holds at a row below
        len(slots) keeps it; the others fill the rows left, in the order given."""
        b = len(slots)
        if b < 2 or not len(self.order):
            return slots
        head = np.full(b, -1, np.int32)
        n = min(b, len(self.order))
        head[:n] = self.order[:n]
        # Membership by slot (a lookup table, not np.isin's sort): index 0 stands for -1.
        size = int(max(slots.max(), head.max())) + 2
        wanted = np.zeros(size, bool)
        wanted[slots + 1] = True
        keep = wanted[head + 1]
        kept = np.zeros(size, bool)
        kept[head[keep] + 1] = True
        out = np.where(keep, head, -1).astype(np.int32)
        out[~keep] = slots[~kept[slots + 1]]
        return out

    def begin_step(self, source: MirrorSource, layout: StepLayout) -> MirrorStep | None:
        """Make the mirror hold every row's positions before this decode step (rows copied in
        where it does not); returns where the step writes and its mask, or None (gather
        instead: a single row, or a copy over the byte limit)."""
        b = layout.batch_size
        if b < 2:
            self.clear()
            return None
        starts = layout.starts.astype(np.int64)
        need = int(starts.max()) + 1
        grow = b > self.row_capacity or need > self.columns
        shrink = self.row_capacity > 8 and b * 4 <= self.row_capacity  # a burst has drained
        if (grow or shrink) and not self._allocate(source, b, need):
            self.clear()
            return None
        held = (self.order[:b] == layout.rows) & (self.held[:b] == starts)
        stale = np.flatnonzero(~held)
        step = MirrorStep(b, need, self._vectors(np.arange(b), starts[:, None]), None)
        if len(stale):
            step.fill_to, step.fill_from = self._copy_plan(source, layout, stale)
            self._register(layout, stale)
            self.copied_rows += len(stale)
        if (starts != starts[0]).any():
            step.mask = mx.array(np.arange(need)[None, :] <= starts[:, None])[:, None, None, :]
        self.order[:b] = layout.rows
        self.held[:b] = starts + 1
        self.step = step
        return step

    def append(
        self,
        layer: int,
        keys: mx.array,
        values: mx.array,
        pools: tuple[mx.array, mx.array],
    ) -> tuple[mx.array, mx.array]:
        """Copy in the step's stale rows from `pools` (the layer's K and V pools as
        [slots * kv_heads, head_dim]: MirrorSource.pool_rows), write the step's new K/V
        ([B, kv_heads, 1, head_dim]) at each row's column; returns views of the rows' K/V up
        to the longest. Each `mirror[...] = x` updates the list's array object in place."""
        step = self.step
        assert step is not None
        out = []
        for mirror, new, pool in zip((self.keys[layer], self.values[layer]), (keys, values), pools):
            if step.fill_to is not None:
                assert step.fill_from is not None
                mirror[step.fill_to] = mx.take(pool, step.fill_from, axis=0)
            mirror[step.write] = new.reshape(-1, self.head_dim).astype(mirror.dtype)
            grid = mirror.reshape(self.row_capacity, self.kv_heads, self.columns, self.head_dim)
            out.append(grid[: step.batch, :, : step.span, :])
        return out[0], out[1]

    def release(self, handle_id: int) -> None:
        """The sequence left: its row holds nothing any more; no row held, the copy is freed."""
        row = self.handles.pop(handle_id, None)
        if row is None:
            return
        self.order[row], self.held[row], self.ids[row] = -1, -1, 0
        if not self.handles:
            self.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def clear(self) -> None:
        self.keys, self.values, self.step = [], [], None
        self.order, self.held = np.zeros(0, np.int32), np.zeros(0, np.int64)
        self.ids = np.zeros(0, np.int64)
        self.handles = {}
        self.row_capacity = self.columns = 0

    # -- helpers ---------------------------------------------------------------------
    def _register(self, layout: StepLayout, stale: np.ndarray) -> None:
        """The stale rows now hold the step's sequences there; a row that held one of them
        before (past the batch: it moved) holds nothing."""
        for i in stale.tolist():  # their occupants leave these rows (some only move)
            self.handles.pop(int(self.ids[i]), None)
        for i in stale.tolist():
            handle = id(layout.handles[i])
            before = self.handles.get(handle)
            if before is not None:
                self.order[before], self.held[before], self.ids[before] = -1, -1, 0
            self.ids[i] = handle
            self.handles[handle] = i

    def _vectors(self, rows: np.ndarray, columns: np.ndarray) -> mx.array:
        """The mirror vectors of (row, head, column), flat in that order: `rows` [n] and
        `columns` [n, T] (or [1, T], the same for every row)."""
        heads = np.arange(self.kv_heads, dtype=np.int64)[None, :, None]
        flat = (rows[:, None, None] * self.kv_heads + heads) * self.columns + columns[:, None, :]
        return mx.array(flat.reshape(-1).astype(np.int32))

    def _copy_plan(
        self, source: MirrorSource, layout: StepLayout, stale: np.ndarray
    ) -> tuple[mx.array, mx.array]:
        """The mirror vectors of the stale rows' positions 0..start-1 and the pool rows they
        come from (past a row's start, the scratch slot: masked until the row writes there)."""
        starts = layout.starts[stale]
        span = max(1, int(starts.max()))
        slots = source.slots_of(layout.block_table[stale], starts, span)
        source_rows = slot_head_rows(slots, self.kv_heads).reshape(-1)
        return self._vectors(stale, np.arange(span)[None, :]), source_rows

    def _allocate(self, source: MirrorSource, batch: int, need: int) -> bool:
        """Arrays for at least `batch` rows and `need` columns (every row copied in at its next
        step); False when they would pass the byte limit."""
        rows = 1 << (max(batch, 2) - 1).bit_length()
        columns = -(-(need + HEADROOM) // COLUMN_ROUND) * COLUMN_ROUND
        vectors = rows * source.kv_heads * columns
        size = 2 * source.num_layers * vectors * source.head_dim * source.dtype.size
        if size > self.max_bytes:
            return False
        self.clear()
        self.kv_heads, self.head_dim = source.kv_heads, source.head_dim
        self.row_capacity, self.columns = rows, columns
        shape = (vectors, source.head_dim)
        self.keys = [mx.zeros(shape, source.dtype) for _ in range(source.num_layers)]
        self.values = [mx.zeros(shape, source.dtype) for _ in range(source.num_layers)]
        self.order = np.full(rows, -1, np.int32)
        self.held = np.full(rows, -1, np.int64)
        self.ids = np.zeros(rows, np.int64)
        self.allocations += 1
        return True


_MASKED = -1e30  # a masked score: its fast_exp (clamped) is ~1e-38, nothing next to the max's 1


def attend(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    """Decode attention over the mirror's views: queries [B, heads, 1, head_dim], keys and
    values [B, kv_heads, T, head_dim], `mask` [B, 1, 1, T] (None: every column). MLX's CPU
    attention is its unfused fallback, whose softmax exp is the costly part; here the
    softmax takes the multiply-add exp (service.core.models.activations), and heads sharing a
    K/V head are one product."""
    b, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    q = (queries * scale).reshape(b, kv_heads, heads // kv_heads, dim)
    scores = q @ keys.swapaxes(-1, -2)  # [B, kv_heads, repeats, T]
    if mask is not None:
        scores = mx.where(mask, scores, _MASKED)
    weights = fast_exp(scores - scores.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return (weights @ values).reshape(b, heads, 1, dim)
