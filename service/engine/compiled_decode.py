"""Decode steps replayed from a compiled graph (`mx.compile`) instead of rebuilt in Python.

A small model's decode step is host-bound on a GPU: building the step's graph (some 20 MLX ops
per layer, each a Python call) takes longer than the device takes to run it. `DecodeGraph`
traces the model's decode forward once per input shape and replays it: each step costs one
call. Everything that changes from step to step is an input array (the step's tokens, RoPE
offsets, each row's slots and length, the write slots) and the pool arrays are inputs too, so
a replay reads the pool as it is now. Shapes are kept few: the slot table is padded to a
multiple of `SLOT_BUCKET` positions (padding reads are never made: the kernel stops at each
row's length), so a batch recompiles only when its size changes or its longest row crosses a
bucket. (MLX's shapeless compile would avoid even that, but custom kernels cannot re-infer
their output shapes.)

Only direct decode steps (one token per row, attention read from the paged pool) are compiled.
Their K/V writes are the in-place CUDA kernel where the storage writes in place; elsewhere a
functional scatter whose new pool arrays the replay returns and the storage adopts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx

from service.engine.batch_view import StepLayout
from service.engine.paged_attention import paged_decode_attention, store_decode_kv

SLOT_BUCKET = 256  # slot-table width granularity: one compiled shape per 256 positions


class _GraphView:
    """What mlx-lm's attention layers see inside the traced forward: one layer's cache, backed
    by the step's input arrays instead of the storage's per-step plan."""

    direct = True  # attention comes back through `attend` (service.engine.paged_attention)

    def __init__(self, step: _StepArrays, layer: int) -> None:
        self._step = step
        self._layer = layer
        self._after: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        return self._step.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        step, layer = self._step, self._layer
        k_pool, v_pool = step.pools[layer], step.pools[step.num_layers + layer]
        if step.in_place:
            self._after = store_decode_kv(k_pool, v_pool, keys, values, step.write)
            return k_pool, v_pool
        k_pool[step.write] = step.storage.token_major(keys)
        v_pool[step.write] = step.storage.token_major(values)
        step.pools[layer], step.pools[step.num_layers + layer] = k_pool, v_pool
        return k_pool, v_pool

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float):
        step = self._step
        return paged_decode_attention(
            queries, keys, values, step.slots, step.lengths, scale, step.span, after=self._after
        )

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return None  # each row's attention stops at its own length

    def __bool__(self) -> bool:
        return True


class _StepArrays:
    def __init__(self, args: list[mx.array], storage: Any, num_layers: int) -> None:
        self.offsets, self.slots, self.lengths, self.write, self.span = args[:5]
        self.pools = list(args[5:])  # K of every layer, then V of every layer
        self.storage = storage
        self.num_layers = num_layers
        self.in_place: bool = storage.write_in_place


class DecodeGraph:
    """Compiled decode forwards (trunk and LM head) of one model over paged storage."""

    def __init__(self, head: Any, storage: Any, num_layers: int) -> None:
        self._head = head  # the engine's ModelHead
        self._storage = storage
        self._num_layers = num_layers
        # A traced graph is bound to the streams of the thread that traced it (the runtime warms
        # up on the main thread, the scheduler thread serves), so each thread compiles its own;
        # and to the storage's write mode at trace time, which MLX's shape-keyed cache ignores.
        self._compiled: dict[tuple[int, bool], Callable[..., list[mx.array]]] = {}

    def logits(self, tokens: mx.array, layout: StepLayout) -> mx.array:
        """[B, V] next-token logits of a decode step (tokens [B, 1]); writes the step's K/V."""
        storage = self._storage
        inputs = storage.decode_inputs(layout, SLOT_BUCKET)
        pools = storage.pool_arrays()
        key = (threading.get_ident(), storage.write_in_place)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = mx.compile(partial(DecodeGraph._forward, self))
            self._compiled[key] = compiled
        logits, *written = compiled(tokens, *inputs, *pools)
        if not storage.write_in_place:
            storage.adopt_pool_arrays(written)
        return logits

    def _forward(self, tokens: mx.array, *args: mx.array) -> list[mx.array]:
        step = _StepArrays(list(args), self._storage, self._num_layers)
        views = [_GraphView(step, layer) for layer in range(self._num_layers)]
        hidden = self._head.hidden(tokens, views)  # [B, 1, H]
        logits = self._head.logits(hidden[:, 0])
        # In place, the pools are untouched inputs: returning them would only copy them.
        return [logits] if step.in_place else [logits, *step.pools]
