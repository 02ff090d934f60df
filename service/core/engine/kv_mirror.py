"""A contiguous copy of the decoding rows' K/V that decode attention reads in place (CPU).

A gathering decode step copies every row's K/V out of the paged pool for every layer, which on
the CPU costs about as much as the attention itself; attention over views of one contiguous
array avoids it (`bench/cpu_mirror.py` measures the two through the scheduler). The mirror
keeps, per layer, one
`[B, kv_heads, capacity, head_dim]` array for the batch's rows, right-aligned like mlx-lm's
batched cache: row i's positions end at the same column for every row, so a decode step
appends all rows' new K/V with one slice update (in place) and attention reads
`[:, :, :column + 1]`, a view; the left padding is masked.

The paged pool stays the source of truth (every step still writes it). The mirror is valid
only while the batch is the same rows in the same order, each exactly one token further than
at the last mirrored step; anything else (a row joins or leaves, a prefill or mixed step in
between, capacity reached) rebuilds it from the pool with one gather: what a gathering step
pays every time, paid once per change of the batch. Except under churn: when the batch
changed at the step before too (closed-loop serving at many rows, where some row ends nearly
every step), a copy rebuilt every step would cost more than the gather it replaces (its
headroom columns, its table), so such a step gathers and the mirror waits for a batch that
steps twice.

The CPU decode path (service.core.engine.config) for models without sliding windows. Left lazy, a
rebuild's gather is consumed by the step's first append; evaluating it at once would stall the
host while the previous step runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from service.core.engine.batch_view import StepLayout

HEADROOM = 128  # columns allocated past the current one at each rebuild


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
    scratch_slot: int

    def pool_rows(self, layer: int) -> tuple[mx.array, mx.array]: ...
    def slot_table(self, batch: StepLayout) -> np.ndarray: ...


@dataclass
class MirrorStep:
    """What one mirrored decode step attends with (the same for every layer)."""

    column: int  # where this step's new K/V goes
    mask: mx.array | None  # [B, 1, 1, column + 1], None when no row is padded


@dataclass
class DecodeMirror:
    max_bytes: int
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # slots
    handle_ids: set[int] = field(default_factory=set)  # the rows' storage handles
    lefts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    column: int = 0  # the next column to write
    capacity: int = 0
    keys: list[mx.array] = field(default_factory=list)
    values: list[mx.array] = field(default_factory=list)
    rebuilds: int = 0
    step: MirrorStep | None = None
    # The rows of the last decode step that asked (mirrored or not), and whether they were
    # the rows of the step before it.
    previous: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    previous_repeated: bool = True

    def begin_step(self, source: MirrorSource, layout: StepLayout) -> MirrorStep | None:
        """Make the mirror hold every row's positions before this decode step; returns where
        the step writes and its mask, or None (gather instead: a single row, churn, or too
        large).
        A lone row gathers only itself, which costs less than keeping a copy of it
        (bench/cpu_mirror.py measures the mirror against the gather)."""
        repeated = np.array_equal(layout.rows, self.previous)
        churn = not repeated and not self.previous_repeated  # changed twice in a row
        self.previous, self.previous_repeated = layout.rows.copy(), repeated
        if layout.batch_size < 2:
            if len(self.rows):
                self.clear()
            return None
        if not self._continues(layout) and (churn or not self._rebuild(source, layout)):
            # Gather: under churn (rebuild once a batch steps twice), or the copy too large.
            self.clear()
            return None
        column = self.column
        self.column += 1
        mask = None
        if self.lefts.any():
            key_pos = mx.arange(column + 1)[None, :]
            mask = (key_pos >= mx.array(self.lefts.astype(np.int32))[:, None])[:, None, None, :]
        self.step = MirrorStep(column, mask)
        return self.step

    def append(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the step's new K/V ([B, kv_heads, 1, head_dim]) at its column; returns views
        of every row's K/V up to it."""
        assert self.step is not None
        c = self.step.column
        k, v = self.keys[layer], self.values[layer]
        k[:, :, c : c + 1, :] = keys.astype(k.dtype)
        v[:, :, c : c + 1, :] = values.astype(v.dtype)
        return k[:, :, : c + 1, :], v[:, :, : c + 1, :]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def clear(self) -> None:
        self.rows, self.keys, self.values, self.step = np.zeros(0, np.int32), [], [], None
        self.handle_ids = set()
        self.capacity = self.column = 0

    # -- helpers ---------------------------------------------------------------------
    def _continues(self, layout: StepLayout) -> bool:
        return (
            self.column < self.capacity
            and np.array_equal(layout.rows, self.rows)
            and bool((layout.starts == self.column - self.lefts).all())
        )

    def _rebuild(self, source: MirrorSource, layout: StepLayout) -> bool:
        starts = layout.starts.astype(np.int64)
        column = int(starts.max())
        capacity = column + HEADROOM
        b = layout.batch_size
        itemsize = source.dtype.size
        size = 2 * source.num_layers * b * source.kv_heads * capacity * source.head_dim * itemsize
        if size > self.max_bytes:
            self.clear()
            return False
        lefts = column - starts
        # Row i's positions 0..start-1, right-aligned to end at `column`.
        read = source.slot_table(layout)
        table = np.full((b, capacity), source.scratch_slot, dtype=np.int32)
        positions = np.arange(column)[None, :]
        held = positions < starts[:, None]
        rows = np.broadcast_to(np.arange(b)[:, None], held.shape)
        cols = positions + lefts[:, None]
        table[rows[held], cols[held]] = read[:, :column][held]
        gather = slot_head_rows(table, source.kv_heads)  # [B, kv_heads, capacity]
        keys, values = [], []
        for layer in range(source.num_layers):
            k_pool, v_pool = source.pool_rows(layer)
            keys.append(mx.take(k_pool, gather, axis=0))
            values.append(mx.take(v_pool, gather, axis=0))
        # Left lazy: the step's first append consumes each gather's output (its only user), so
        # MLX updates it in place without the host waiting here for the step in flight.
        self.rows = layout.rows.copy()
        self.handle_ids = {id(h) for h in layout.handles}
        self.lefts, self.column, self.capacity = lefts, column, capacity
        self.keys, self.values = keys, values
        self.rebuilds += 1
        return True
