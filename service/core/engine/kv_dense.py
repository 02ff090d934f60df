"""Dense KV storage: each sequence owns contiguous per-layer K/V arrays."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from service.core.engine.batch_view import StepLayout, make_views
from service.core.engine.state_store import StepStates
from service.core.kv.block_pool import BlockUpdate
from service.core.models.layout import CacheLayout

_GROW_STEP = 256  # tokens; capacity grows in steps so writes are in-place slice updates


class DenseSequenceKV:
    """One sequence's cache: per layer K and V of shape [kv_heads, capacity, head_dim]."""

    __slots__ = ("capacity", "keys", "values")

    def __init__(self, num_layers: int) -> None:
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.capacity = 0

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values if a is not None)


class DenseKVStorage:
    name = "dense"

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * dtype.size
        self._live: set[int] = set()
        self._reserved_bytes = 0

    def new_sequence(self) -> DenseSequenceKV:
        seq = DenseSequenceKV(self.num_layers)
        self._live.add(id(seq))
        return seq

    def release(self, seq: DenseSequenceKV) -> None:
        self._live.discard(id(seq))
        self._reserved_bytes -= seq.capacity * self.bytes_per_token
        seq.keys = [None] * self.num_layers
        seq.values = [None] * self.num_layers
        seq.capacity = 0

    def decode_order(self, slots: np.ndarray) -> np.ndarray:
        return slots

    def apply(self, update: BlockUpdate) -> None:
        pass  # no blocks: each sequence's arrays grow as they are written

    def end_forward(self) -> None:
        """Nothing is held past a layer here."""

    def views(
        self,
        layout: StepLayout,
        cache: CacheLayout,
        states: StepStates | None,
        grouped_mask: bool,
        gather: bool = False,
        prompt: bool = False,
    ) -> list[Any]:
        """Every step gathers (rows' arrays sliced and padded to the longest)."""
        return make_views(self, cache, layout, states, "gather", None, grouped_mask)

    @property
    def live_sequences(self) -> int:
        return len(self._live)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

    def _ensure_capacity(self, seq: DenseSequenceKV, layer: int, needed: int) -> None:
        if layer == 0 and needed > seq.capacity:
            new_cap = (needed + _GROW_STEP - 1) // _GROW_STEP * _GROW_STEP
            self._reserved_bytes += (new_cap - seq.capacity) * self.bytes_per_token
            seq.capacity = new_cap
        current = seq.keys[layer]
        if current is not None and current.shape[1] >= seq.capacity:
            return
        shape = (self.kv_heads, seq.capacity, self.head_dim)
        fresh_k = mx.zeros(shape, dtype=self.dtype)
        fresh_v = mx.zeros(shape, dtype=self.dtype)
        if current is not None:
            used = current.shape[1]
            fresh_k[:, :used] = current
            fresh_v[:, :used] = seq.values[layer]
        seq.keys[layer], seq.values[layer] = fresh_k, fresh_v

    def write_and_gather(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        # keys/values: [B, kv_heads, N, head_dim]
        width = batch.span
        out_k, out_v = [], []
        for i, seq in enumerate(batch.handles):
            start, n = batch.starts[i], batch.lengths[i]
            self._ensure_capacity(seq, layer, start + n)
            k_store, v_store = seq.keys[layer], seq.values[layer]
            k_store[:, start : start + n] = keys[i, :, :n].astype(self.dtype)
            v_store[:, start : start + n] = values[i, :, :n].astype(self.dtype)
            if batch.batch_size == 1 and width == start + n:
                return k_store[None, :, : start + n], v_store[None, :, : start + n]
            k_row, v_row = k_store[:, :width], v_store[:, :width]
            if k_row.shape[1] < width:
                pad = [(0, 0), (0, width - k_row.shape[1]), (0, 0)]
                k_row, v_row = mx.pad(k_row, pad), mx.pad(v_row, pad)
            out_k.append(k_row)
            out_v.append(v_row)
        return mx.stack(out_k), mx.stack(out_v)
