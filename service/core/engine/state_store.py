"""Per-sequence recurrent state (Mamba, gated-delta, short-convolution layers) beside the pool.

A recurrent layer replaces its whole state every forward (mlx-lm's `ArraysCache`: the layer
reads `cache[i]` and assigns `cache[i] = new`). We keep each sequence's arrays, and hand a
step's layer the rows' states stacked along the batch axis (`StateView`). Arrays are values,
never updated in place, so a step's inputs stay valid until it is read: a failed step is undone
by putting the previous arrays back.

Steady decoding would stack and split every row's state every step. Instead, the arrays a
batched step produced are kept whole, keyed by the step's rows in order; the next step over
the same rows reads them as they are, and only a change of the batch splits them back into
per-row arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from service.core.models.layout import StateEntry


@dataclass(eq=False)
class SequenceState:
    """One sequence's recurrent state: per state layer, its arrays (None before the first
    forward) with a batch axis of 1."""

    layers: list[list[mx.array] | None]
    released: bool = False


@dataclass
class StateUndo:
    """What a step replaced: enough to put the store back as it was before the step."""

    batch: tuple[tuple[int, ...], list[SequenceState], list[list[mx.array] | None]] | None
    rows: list[tuple[SequenceState, list[list[mx.array] | None]]] = field(default_factory=list)


class StateStore:
    def __init__(self, entries: tuple[StateEntry, ...]) -> None:
        self.entries = entries
        self.bytes_per_sequence = sum(e.nbytes for e in entries)
        self._live = 0
        # The last batched step's outputs, whole: (row ids, rows, per layer arrays [B, ...]).
        self._batch: tuple[tuple[int, ...], list[SequenceState], list[list[mx.array] | None]]
        self._batch = None  # type: ignore[assignment]

    @property
    def live_sequences(self) -> int:
        return self._live

    def new_sequence(self) -> SequenceState:
        self._live += 1
        return SequenceState([None] * len(self.entries))

    def release(self, state: SequenceState) -> None:
        if not state.released:
            state.released = True
            self._live -= 1
        state.layers = [None] * len(self.entries)

    # -- a step ------------------------------------------------------------------------
    def begin(self, rows: list[SequenceState]) -> StepStates:
        """The states of a step over `rows`, in order."""
        key = tuple(id(r) for r in rows)
        if self._batch is not None and self._batch[0] != key:
            self._split_batch()
        return StepStates(self, rows, key)

    def _split_batch(self) -> None:
        """Give each row of the kept batch its own slices again."""
        assert self._batch is not None
        _, rows, layers = self._batch
        self._batch = None
        for i, row in enumerate(rows):
            if row.released:
                continue
            row.layers = [
                None if arrays is None else [a[i : i + 1] for a in arrays] for arrays in layers
            ]

    def undo(self, undo: StateUndo) -> None:
        self._batch = undo.batch
        for row, layers in undo.rows:
            row.layers = layers


class StepStates:
    """The recurrent state of one step's rows: read per layer, replaced per layer."""

    def __init__(self, store: StateStore, rows: list[SequenceState], key: tuple[int, ...]):
        self._store = store
        self._rows = rows
        self._key = key
        self._new: list[list[mx.array | None] | None] = [None] * len(store.entries)
        self.undo = StateUndo(store._batch, [(r, list(r.layers)) for r in rows])

    def get(self, layer: int, index: int) -> mx.array | None:
        new = self._new[layer]
        if new is not None and new[index] is not None:
            return new[index]
        batch = self._store._batch
        if batch is not None and batch[0] == self._key:
            arrays = batch[2][layer]
            return None if arrays is None else arrays[index]
        if len(self._rows) == 1:
            arrays = self._rows[0].layers[layer]
            return None if arrays is None else arrays[index]
        parts = [r.layers[layer] for r in self._rows]
        if all(p is None for p in parts):
            return None
        entry = self._store.entries[layer]
        shape, dtype = entry.shapes[index], entry.dtypes[index]
        return mx.concatenate(
            [mx.zeros((1, *shape), dtype) if p is None else p[index] for p in parts]
        )

    def set(self, layer: int, index: int, value: mx.array) -> None:
        if self._new[layer] is None:
            self._new[layer] = [None] * len(self._store.entries[layer].shapes)
        self._new[layer][index] = value

    def commit(self) -> None:
        """Make the step's new arrays the rows' states (after the forward was built)."""
        store = self._store
        layers: list[list[mx.array] | None] = []
        for layer, new in enumerate(self._new):
            old = [self.get(layer, i) for i in range(len(store.entries[layer].shapes))]
            if new is None:
                layers.append(None if any(a is None for a in old) else old)  # type: ignore[arg-type]
                continue
            layers.append([n if n is not None else o for n, o in zip(new, old)])  # type: ignore[misc]
        if len(self._rows) == 1:
            self._rows[0].layers = layers
            if store._batch is not None and store._batch[0] == self._key:
                store._batch = None
        else:
            store._batch = (self._key, list(self._rows), layers)


class StateView(ArraysCache):
    """What a recurrent layer of mlx-lm sees as its `ArraysCache` for one step (a subclass,
    because some layers only write their state back into an `ArraysCache`). Rows are never
    padded in time here (a multi-token forward of a stateful model has one row), so there are
    no lengths or left padding to apply, and no mask."""

    lengths = None
    left_padding = None

    def __init__(self, states: StepStates, layer: int) -> None:  # no ArraysCache storage
        self._states = states
        self._layer = layer

    def __getitem__(self, index: int) -> mx.array | None:
        return self._states.get(self._layer, index)

    def __setitem__(self, index: int, value: mx.array) -> None:
        self._states.set(self._layer, index, value)

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, n: int) -> None:
        return None

    def __bool__(self) -> bool:
        return True
