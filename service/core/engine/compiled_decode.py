"""Decode steps replayed from a compiled graph (`mx.compile`) instead of rebuilt in Python.

A small model's decode step is host-bound on a GPU: building the step's graph (some 20 MLX ops
per layer, each a Python call) takes longer than the device takes to run it. `DecodeGraph`
traces the model's decode forward once per input shape and replays it: each step costs one
call. Everything that changes from step to step is an input array (the step's tokens, and one
packed array of the rows' RoPE offsets, lengths, write slots and block tables) and the pool
arrays are inputs too, so a replay reads the pool as it is now. Shapes are kept few, so that
the traced graph and MLX's CUDA graphs are replayed rather than rebuilt: the rows are padded to
a bucket (`row_bucket`: padding rows attend to and write only the scratch slot) and the block
table to a multiple of `SLOT_BUCKET` positions (padding reads are never made: the kernel stops
at each row's length). A batch recompiles only when its bucket changes or its longest row
crosses a slot bucket; the runtime traces every row bucket at start. (MLX's shapeless compile
would avoid even that, but custom kernels cannot re-infer their output shapes.) A batch whose
rows all sample greedily takes its tokens from the graph too.

A batch with LoRA adapter rows replays a graph of its own that takes the rows' adapter slots as
one more input (a slot array read from outside the traced function would be frozen into it).
The adapters' weights are constants of a trace: loading or unloading one drops the traces
(`reset`).

Only direct decode steps (one token per row, attention read from the paged pool) are compiled,
with their K/V written by the in-place CUDA kernel: the CUDA decode path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from service.core.engine.batch_view import StepLayout
from service.core.engine.kv_paged import unpack_decode_inputs
from service.core.engine.paged_attention import NewKV, paged_decode_attention, store_decode_kv
from service.core.models import lora, rope
from service.core.models.layout import AttentionEntry, CacheLayout
from service.core.models.rope import Rotation

SLOT_BUCKET = 256  # block-table width granularity: one compiled shape per 256 positions
ROW_STEP = 32  # rows: powers of two up to this, then multiples of it


def row_bucket(rows: int) -> int:
    """The compiled batch size that holds `rows` rows."""
    if rows <= ROW_STEP:
        return 1 << max(0, rows - 1).bit_length()
    return -(-rows // ROW_STEP) * ROW_STEP


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a batch of up to max_rows rows can take."""
    out = sorted({row_bucket(n) for n in range(1, max_rows + 1)})
    return out


class _GraphView:
    """What mlx-lm's attention layers see inside the traced forward: one layer's cache, backed
    by the step's input arrays instead of the storage's per-step plan."""

    direct = True  # attention comes back through `attend` (service.core.engine.paged_attention)

    def __init__(self, step: _StepArrays, entry: AttentionEntry) -> None:
        self._step = step
        self._layer = entry.pool_layer
        self._window = entry.window
        # The layer's new K/V and their keys' deferred RoPE, for its attention kernel to write.
        self.pending: tuple[NewKV, Rotation | None] | None = None

    @property
    def offset(self) -> mx.array:
        return self._step.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        step, layer = self._step, self._layer
        rotation = rope.take(keys)  # deferred by the layer's RoPE: the write applies it
        self.pending = (NewKV(keys, values, step.write), rotation)
        return step.pools[layer], step.pools[step.num_layers + layer]

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float):
        step = self._step
        rotation = rope.take(queries)
        rope.settle()
        new, after = self.pending or (None, None), None
        self.pending = None
        if new[0] is not None and new[1] is not rotation:
            # The keys' RoPE is not the queries': the store kernel writes them first.
            kv, key_rotation = new
            after = store_decode_kv(
                keys, values, kv.keys, kv.values, kv.slots, step.lengths, key_rotation
            )
            new = (None, None)
        return paged_decode_attention(
            queries,
            keys,
            values,
            step.blocks,
            step.lengths,
            scale,
            after=after,
            window=self._window,
            block=step.block_size,
            rotation=rotation,
            store=new[0],
        )

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return None  # each row's attention stops at its own length

    def __bool__(self) -> bool:
        return True


class _StepArrays:
    def __init__(
        self, packed: mx.array, rows: int, pools: list[mx.array], num_layers: int, block_size: int
    ) -> None:
        self.offsets, self.lengths, self.write, self.blocks = unpack_decode_inputs(packed, rows)
        self.block_size = block_size
        self.pools = pools  # K of every layer, then V of every layer
        self.num_layers = num_layers


class DecodeGraph:
    """Compiled decode forwards (trunk and LM head) of one model over paged storage."""

    def __init__(self, head: Any, storage: Any, cache: CacheLayout) -> None:
        if cache.stateful or len(cache.attention_entries()) != len(cache.entries):
            raise ValueError("compiled decode steps take models with attention layers only")
        if not storage.write_in_place:
            raise ValueError("compiled decode steps write the pool in place (CUDA)")
        self._head = head  # the engine's ModelHead
        self._storage = storage
        self._entries = cache.attention_entries()
        self._num_layers = cache.num_attention
        # A traced graph is bound to the streams of the thread that traced it, so each thread
        # compiles its own (tests drive engines from several threads).
        self._compiled: dict[tuple[int, bool, bool], Callable[..., list[mx.array]]] = {}

    def reset(self) -> None:
        """Forget the traced graphs (the adapters they hold as constants changed)."""
        self._compiled.clear()

    def logits(
        self,
        tokens: mx.array,
        layout: StepLayout,
        greedy: bool = False,
        rows: int = 0,
        adapters: np.ndarray | None = None,
    ) -> mx.array:
        """[B, V] next-token logits of a decode step (tokens [B, 1]), or with `greedy` the [B]
        argmax tokens; writes the step's K/V. `rows`: the compiled batch (default: B's
        bucket); `adapters`: the rows' LoRA adapter slots (None: no row has one)."""
        b = tokens.shape[0]
        padded = max(rows, row_bucket(b))
        packed = self._storage.decode_inputs(layout, SLOT_BUCKET, padded)
        if padded > b:
            tokens = mx.concatenate([tokens, mx.zeros((padded - b, 1), tokens.dtype)])
        adapted = adapters is not None
        key = (threading.get_ident(), greedy, adapted)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = mx.compile(partial(DecodeGraph._forward, self, greedy, adapted))
            self._compiled[key] = compiled
        inputs = [tokens, packed]
        if adapters is not None:
            slots = np.zeros(padded, np.int32)  # padding rows: no adapter
            slots[:b] = adapters
            inputs.append(mx.array(slots))
        (out,) = compiled(*inputs, *self._storage.pool_arrays())
        return out if padded == b else out[:b]

    def _forward(self, greedy: bool, adapted: bool, *inputs: mx.array):
        tokens, packed = inputs[:2]
        rows = lora.RowAdapters(inputs[2]) if adapted else None
        pools = list(inputs[3:] if adapted else inputs[2:])
        step = _StepArrays(
            packed, tokens.shape[0], pools, self._num_layers, self._storage.block_size
        )
        views = [_GraphView(step, entry) for entry in self._entries]
        # The layers' RoPE calls recognize this step by its offsets array.
        rope.begin_step(step.offsets if self._storage.rope_in_kernels else None)
        hidden = self._head.hidden(tokens, views, rows)  # [B, 1, H]
        if any(view.pending is not None for view in views):
            raise RuntimeError(
                "a layer's new K/V were never written: its attention did not come through the "
                "decode kernel"
            )
        logits = self._head.logits(hidden[:, 0], rows)
        # The pools are written in place: returning them would only copy them.
        return [mx.argmax(logits, axis=-1).astype(mx.int32) if greedy else logits]
