"""Paged KV storage: every sequence's K/V lives in one block pool shared by all sequences.

Per layer there is ONE K and ONE V array of flat slots, `[(capacity + 1) * block_size,
kv_heads, head_dim]`; slot `block_id * block_size + offset` holds one token position. The
bookkeeping (block tables, ref counts, prefix cache, copy-on-write) is the scheduler's
`KVCacheManager` (service.core.kv.block_pool); this module moves the bytes: each step brings the
rows' block tables (in its StepLayout) and a `BlockUpdate` (`apply`: grow the arrays to the
manager's capacity, copy blocks). The last physical block is a scratch block the pool never
hands out: padding positions of a ragged step are written there and padding reads come from
there.

A step costs, per layer, one scatter of the new tokens' K/V into the pool and one take of every
row's positions 0..end into a `[B, kv_heads, T, head_dim]` array (right-padded; the BatchView
mask hides the padding). Slot indices are computed once per step on the CPU and reused by all
layers. The scatter updates the pool in place only while nothing else references the pool's
buffer when the step is dispatched: see `write_and_gather`. A decode step can instead attend
over the storage's decode mirror (`decode_attention`, kv_mirror), a contiguous copy of the
batch that it appends to, or read the pool directly (`attend`, the CUDA kernel).

Slots are reserved before a forward is built, never while the model runs: a step whose
positions run past its rows' block tables is refused (`SlotsNotReservedError`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import mlx.core as mx
import numpy as np

from service.core.engine.batch_view import StepLayout, make_views
from service.core.engine.kv_mirror import DecodeMirror, slot_head_rows
from service.core.engine.kv_mirror import attend as mirror_attention
from service.core.engine.memory import release_freed_memory
from service.core.engine.paged_attention import NewKV, paged_decode_attention, store_decode_kv
from service.core.engine.state_store import StepStates
from service.core.kv.block_pool import BlockUpdate
from service.core.models.layout import CacheLayout
from service.core.models.rope import Rotation

MIRROR_MAX_BYTES = 1 << 30  # past this (big batch x long rows), decode steps gather instead


class SlotsNotReservedError(RuntimeError):
    """A step writes positions its row's block table does not cover (a scheduler bug: slots
    are reserved before the forward is built)."""


@dataclass(eq=False)
class PagedSequenceKV:
    """One sequence's handle (its block table comes with each step, from the scheduler's
    KVCacheManager)."""


@dataclass
class _StepPlan:
    """One step's slot indices (host arrays), turned into device arrays on first use: a
    gathering step reads `read`, a direct decode step `slots` and `lengths`."""

    write_slots: np.ndarray  # [B * N] slot of each new token position (padding -> scratch)
    table_of: Callable[[], np.ndarray]  # makes slot_table: only gathers and kernels read it
    totals: list[int]  # positions each row attends to
    kv_heads: int
    # layer -> its new K/V (and their keys' deferred RoPE), for its attention kernel to write
    pending: dict[int, tuple[NewKV, Rotation | None]] = field(default_factory=dict)

    @cached_property
    def slot_table(self) -> np.ndarray:
        """[B, T] slot of each position (padding -> scratch slot)."""
        return self.table_of()

    @cached_property
    def write(self) -> mx.array:
        return mx.array(self.write_slots)

    @cached_property
    def read(self) -> mx.array:
        """[B, kv_heads, T] pool row of each gathered (position, head)."""
        return slot_head_rows(self.slot_table, self.kv_heads)

    @cached_property
    def slots(self) -> mx.array:
        return mx.array(self.slot_table)

    @cached_property
    def lengths(self) -> mx.array:
        return mx.array(np.asarray(self.totals, dtype=np.int32))


class PagedKVStorage:
    name = "paged"

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        num_blocks: int,
        block_size: int = 16,
        initial_blocks: int = 64,
        *,
        decode_attention: str = "gather",
        in_place: bool = False,
        mirror_attends: bool = False,
        rope_in_kernels: bool = False,
    ) -> None:
        """decode_attention: how decode steps read K/V ("gather" from the pool, "mirror": a
        contiguous copy of the batch, service.core.engine.kv_mirror, "direct": the CUDA kernel reads
        the pool); in_place: direct decode steps write their K/V with the in-place CUDA kernel
        (`store_decode_kv`), so steps can overlap; mirror_attends: mirrored decode steps compute
        attention themselves (kv_mirror.attend). The engine config decides all three."""
        if num_blocks < 1:
            raise ValueError(f"a paged pool needs at least one block, got {num_blocks}")
        if decode_attention not in ("gather", "mirror", "direct"):
            raise ValueError(f"unknown decode attention {decode_attention!r}")
        if rope_in_kernels and decode_attention != "direct":
            raise ValueError("RoPE in the decode kernels needs direct decode attention")
        # Direct decode steps leave q's and k's RoPE to `attend` and `write`
        # (service.core.models.rope.DeferredRoPE).
        self.rope_in_kernels = rope_in_kernels
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * dtype.size
        self.bytes_per_block = block_size * self.bytes_per_token
        # The budget fixes the logical pool; the physical arrays cover the manager's `capacity`
        # (BlockUpdate), which it raises only when every block below it is in use, so an `auto`
        # budget of many GiB costs nothing until that many blocks are live at once. The
        # physical block after the last one is the scratch block.
        self._capacity_blocks = 0
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._grow(min(num_blocks, initial_blocks))
        self._live: set[int] = set()
        self._plan_layout: weakref.ref[StepLayout] | None = None
        self._plan: _StepPlan | None = None
        self._plan_layer = 0  # the last layer that asked for the plan
        self.decode_attention = decode_attention
        self.mirror = DecodeMirror(MIRROR_MAX_BYTES) if decode_attention == "mirror" else None
        self.write_in_place = in_place
        self.mirror_attends = mirror_attends

    # -- sequences -------------------------------------------------------------------
    def new_sequence(self) -> PagedSequenceKV:
        handle = PagedSequenceKV()
        self._live.add(id(handle))
        return handle

    def release(self, handle: PagedSequenceKV) -> None:
        """Forget the sequence (its blocks are the scheduler's to free)."""
        self._live.discard(id(handle))
        if self.mirror is not None:
            self.mirror.release(id(handle))

    def decode_order(self, slots: np.ndarray) -> np.ndarray:
        """A decode step's slots in the order its forward runs them: the mirror's, where
        decode steps attend over it (kv_mirror.DecodeMirror.order_rows)."""
        return slots if self.mirror is None else self.mirror.order_rows(slots)

    def apply(self, update: BlockUpdate) -> None:
        """Before a forward: grow the arrays to the manager's capacity, then copy blocks."""
        if update.capacity > self._capacity_blocks:
            self._grow(min(update.capacity, self.num_blocks))
        self._apply_copies(update.copies)

    def views(
        self,
        layout: StepLayout,
        cache: CacheLayout,
        states: StepStates | None,
        grouped_mask: bool,
        gather: bool = False,
        prompt: bool = False,
    ) -> list[Any]:
        """The model's cache views for one forward. A decode step (one token per row,
        unpadded; not `gather`, a verification) attends as `decode_attention` says, but never
        over the mirror for a `prompt` forward (a prompt's one-token chunk: it would pull its
        rows into the mirror out of order, or free it for a lone row); a multi-token forward
        whose rows all start at position 0 attends over its own new K/V (`write_fresh`);
        everything else gathers."""
        mode, mirror_mask = "gather", None
        if not gather and layout.width == 1 and not layout.padded:
            if self.decode_attention == "direct":
                mode = "direct"
            elif self.mirror is not None and not prompt:
                step = self.mirror.begin_step(self, layout)
                if step is not None:
                    mode, mirror_mask = "mirror", step.mask
        elif not gather and not layout.starts.any():
            mode = "fresh"
        return make_views(
            self,
            cache,
            layout,
            states,
            mode,
            mirror_mask,
            grouped_mask,
            self.mirror_attends,
            defer_rope=mode == "direct" and self.rope_in_kernels,
        )

    # -- stats -----------------------------------------------------------------------
    @property
    def live_sequences(self) -> int:
        return len(self._live)

    @property
    def reserved_bytes(self) -> int:
        """The K/V arrays allocated so far, scratch block and decode mirror included."""
        mirror = self.mirror.nbytes if self.mirror is not None else 0
        return (self._capacity_blocks + 1) * self.bytes_per_block + mirror

    @property
    def capacity_blocks(self) -> int:
        """Blocks the physical arrays cover now (the scratch block aside)."""
        return self._capacity_blocks

    @property
    def scratch_slot(self) -> int:
        return self._capacity_blocks * self.block_size

    @property
    def num_slots(self) -> int:
        return (self._capacity_blocks + 1) * self.block_size

    # -- the forward -----------------------------------------------------------------
    def write(
        self,
        layer: int,
        batch: StepLayout,
        keys: mx.array,
        values: mx.array,
        rotation: Rotation | None = None,
        offset: int | mx.array = 0,
    ) -> tuple[mx.array, mx.array]:
        """A direct decode step's write (`attend` reads the pool next): the rows' new K/V
        ([B, kv_heads, 1, head_dim]) into their slots; returns the layer's pool arrays. With
        `write_in_place` the layer's attention kernel writes them (`attend`), in place;
        otherwise `_scatter` now. `rotation`: the keys' deferred RoPE (at the rows'
        `offset`)."""
        if not (self.write_in_place and batch.width == 1):
            if rotation is not None:
                keys = rotation.apply(keys, offset)
            return self._scatter(layer, batch, keys, values)
        plan = self._step_plan(layer, batch)
        if plan.pending:
            raise RuntimeError(
                f"layer {next(iter(plan.pending))}'s new K/V were never written: its attention "
                "did not come through the decode kernel"
            )
        plan.pending[layer] = (NewKV(keys, values, plan.write), rotation)
        return self._keys[layer], self._values[layer]

    def end_forward(self) -> None:
        """The forward's layers are built: a direct step's new K/V that `write` held for the
        layer's attention kernel and no attention took would be lost; raise instead (the last
        layer's: a lower layer's is caught by the next `write`)."""
        plan = self._plan
        if plan is not None and plan.pending:
            layer = next(iter(plan.pending))
            plan.pending.clear()
            raise RuntimeError(
                f"layer {layer}'s new K/V were never written: its attention did not come "
                "through the decode kernel"
            )

    def _scatter(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write the rows' new K/V ([B, kv_heads, N, head_dim]) into their slots; returns the
        layer's pool arrays ([slots, kv_heads, head_dim]) as written.

        `store[idx] = x` replaces the pool in place only if, when the step is dispatched, no
        other array or queued task still references the pool's buffer; otherwise MLX copies
        the whole pool for that layer. So nothing here keeps a reference to a pool array
        beyond the lazy graph, and a step that scatters is not queued while another runs."""
        plan = self._step_plan(layer, batch)
        k_store, v_store = self._keys[layer], self._values[layer]
        k_store[plan.write] = self.token_major(keys)
        v_store[plan.write] = self.token_major(values)
        return k_store, v_store

    def token_major(self, x: mx.array) -> mx.array:
        """[B, kv_heads, N, head_dim] -> [B * N, kv_heads, head_dim] in the pool's dtype, with
        as few graph nodes as the shape allows (a decode step runs this 2 x layers times)."""
        b, _, n, _ = x.shape
        if n > 1:
            x = x.transpose(0, 2, 1, 3)
        x = x.reshape(b * n, self.kv_heads, self.head_dim)
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def write_and_gather(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """`_scatter`, then every row's positions 0..end-1 as [B, kv_heads, T, head_dim]."""
        self._scatter(layer, batch, keys, values)  # updates the pool arrays pool_rows views
        plan = self._step_plan(layer, batch)
        # Gathering (slot, head) rows straight into [B, kv_heads, T, head_dim] gives attention
        # a contiguous operand; taking [B, T] slots and transposing the result hands the CPU
        # attention a strided K/V view, which it reads far slower.
        k_rows, v_rows = self.pool_rows(layer)
        return mx.take(k_rows, plan.read, axis=0), mx.take(v_rows, plan.read, axis=0)

    def write_fresh(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """`_scatter`, then the rows' own new K/V ([B, kv_heads, N, head_dim]): rows with
        nothing cached before this forward attend over their own tokens, as mlx-lm's lone
        prefill does, and gathering them back from the pool would only copy them. The
        returned arrays depend on the write, so evaluating the forward writes the pool."""
        k_store, v_store = self._scatter(layer, batch, keys, values)
        return tuple(mx.depends([keys, values], [k_store, v_store]))

    def write_mirrored(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """`_scatter`, then append to the mirror; returns views of the mirror up to this step,
        which depend on the pool's write: attention reads only the mirror, and a write that
        no step evaluates would wait in the graph, each step's on the last, until a read of
        the pool (a prefill's) ran them all at once."""
        k_store, v_store = self._scatter(layer, batch, keys, values)
        assert self.mirror is not None
        views = self.mirror.append(layer, keys, values, self.pool_rows(layer))
        return tuple(mx.depends(list(views), [k_store, v_store]))

    def attend_mirrored(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float
    ) -> mx.array:
        """A mirrored decode step's attention over the views `write_mirrored` returned."""
        assert self.mirror is not None and self.mirror.step is not None
        return mirror_attention(queries, keys, values, scale, self.mirror.step.mask)

    def pool_rows(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's K and V pools viewed as [slots * kv_heads, head_dim]."""
        rows = self.num_slots * self.kv_heads
        return (
            self._keys[layer].reshape(rows, self.head_dim),
            self._values[layer].reshape(rows, self.head_dim),
        )

    def attend(
        self,
        layer: int,
        batch: StepLayout,
        queries: mx.array,
        k_pool: mx.array,
        v_pool: mx.array,
        scale: float,
        window: int | None = None,
        rotation: Rotation | None = None,
    ) -> mx.array:
        """Decode attention of the step's rows read through their slots (after `write`), over
        their last `window` positions for a sliding-window layer; `rotation`: the queries'
        deferred RoPE."""
        plan = self._step_plan(layer, batch)
        new, after = plan.pending.pop(layer, (None, None)), None
        if new[0] is not None and new[1] is not rotation:
            # The keys' RoPE is not the queries': the store kernel writes them first.
            kv, key_rotation = new
            after = store_decode_kv(
                k_pool, v_pool, kv.keys, kv.values, kv.slots, plan.lengths, key_rotation
            )
            new = (None, None)
        return paged_decode_attention(
            queries,
            k_pool,
            v_pool,
            plan.slots,
            plan.lengths,
            scale,
            after=after,
            window=window,
            rotation=rotation,
            store=new[0],
        )

    def decode_inputs(self, batch: StepLayout, bucket: int, rows: int) -> mx.array:
        """A direct decode step's plan as one flat int32 array, for a compiled forward
        (compiled_decode): each row's RoPE offset, then each row's length, then each row's write
        slot, then the rows' block tables ([rows, W]: W = the span's blocks, rounded up to
        `bucket` positions, padded with the scratch block); `unpack_decode_inputs` splits it.
        Rows past the batch's are padding: they attend to and write only the scratch slot.
        Block ids, not slots: the array is copied to the device every step, and a slot table is
        `block_size` times as large. Field by field, so that every part is a contiguous view:
        a custom kernel copies each strided input it is given, in every layer."""
        self._check_covered(batch)
        size = self.block_size
        b = batch.batch_size
        blocks = -(-batch.span // size)
        width = -(-blocks * size // bucket) * bucket // size
        packed = np.full(rows * (3 + width), self._capacity_blocks, dtype=np.int32)  # scratch
        offsets, lengths, write, table_out = unpack_decode_inputs(packed, rows)
        offsets[:b] = batch.starts
        offsets[b:] = 0
        lengths[:b] = batch.total_lengths
        lengths[b:] = 1
        table = batch.block_table
        cols = min(blocks, table.shape[1])
        table_out[:b, :cols] = table[:, :cols]
        own = table[np.arange(b), batch.starts // size]  # the block of each row's new token
        write[:b] = own * size + batch.starts % size
        write[b:] = self.scratch_slot
        if batch.padding_rows:
            write[b - batch.padding_rows : b] = self.scratch_slot
        return mx.array(packed)

    def pool_arrays(self) -> list[mx.array]:
        """Every layer's K pool, then every layer's V pool."""
        return [*self._keys, *self._values]

    def gather(self, block_ids: Sequence[int], layer: int, num_tokens: int) -> tuple[mx.array, ...]:
        """The first num_tokens K and V of one layer of the sequence with this block table,
        [kv_heads, num_tokens, head_dim] (for tests and debugging)."""
        table = np.asarray(block_ids, dtype=np.int32)
        slots = (table[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)
        slots = mx.array(slots[:num_tokens])
        k = mx.take(self._keys[layer], slots, axis=0).transpose(1, 0, 2)
        v = mx.take(self._values[layer], slots, axis=0).transpose(1, 0, 2)
        return k, v

    # -- helpers ---------------------------------------------------------------------
    def _step_plan(self, layer: int, batch: StepLayout) -> _StepPlan:
        """Slot indices of one step, computed once and reused by every layer (and by the
        write, gather and attend calls of a layer). A forward visits its layers in order, so
        a lower layer with the same layout is a new pass and gets a fresh plan."""
        cached = self._plan_layout() if self._plan_layout is not None else None
        fresh_pass = layer < self._plan_layer
        self._plan_layer = layer
        if cached is batch and self._plan is not None and not fresh_pass:
            return self._plan
        self._check_covered(batch)
        b, n = batch.batch_size, batch.width
        size = self.block_size
        # Each new token's slot straight from its block: the [B, T] table of every position
        # is made only for the steps that read it (gathers, the decode kernel).
        pos = batch.starts[:, None] + np.arange(n, dtype=np.int32)[None, :]  # [B, N]
        new = np.arange(n)[None, :] < batch.lengths[:, None]
        cols = np.minimum(pos // size, batch.block_table.shape[1] - 1)
        write = np.take_along_axis(batch.block_table, cols, axis=1) * size + pos % size
        write[~new] = self.scratch_slot
        if batch.padding_rows:
            write[b - batch.padding_rows :] = self.scratch_slot
        self._plan = _StepPlan(
            write.reshape(-1).astype(np.int32, copy=False),
            partial(self._slot_table, batch),
            batch.total_lengths.tolist(),
            self.kv_heads,
        )
        self._plan_layout = weakref.ref(batch)
        return self._plan

    def slot_table(self, batch: StepLayout) -> np.ndarray:
        """[B, span] slot of each row's positions 0..end-1 under its block table; the scratch
        slot past each row's end. Refuses positions the tables do not cover."""
        self._check_covered(batch)
        return self._slot_table(batch)

    def _slot_table(self, batch: StepLayout) -> np.ndarray:
        """`slot_table` of a batch already checked (a step's plan checks it once)."""
        return self.slots_of(batch.block_table, batch.total_lengths, batch.span)

    def slots_of(self, table: np.ndarray, ends: np.ndarray, span: int) -> np.ndarray:
        """[rows, span] slot of each position 0..span-1 under the rows' block tables
        (`table`, covering them); the scratch slot from each row's `ends` on."""
        size = self.block_size
        b, cols = table.shape
        nb = -(-span // size)  # blocks the span touches (the last column repeats past them)
        blocks = table[:, :nb] if nb <= cols else table[:, np.minimum(np.arange(nb), cols - 1)]
        # Each block's slots in one broadcast [B, nb, size], then cut to the span.
        read = np.empty((b, nb, size), np.int32)
        np.multiply(blocks[:, :, None], size, out=read)
        read += np.arange(size, dtype=np.int32)
        read = read.reshape(b, nb * size)[:, :span]
        np.putmask(read, np.arange(span)[None, :] >= ends[:, None], self.scratch_slot)
        return read

    def _check_covered(self, batch: StepLayout) -> None:
        """Refuse positions the rows' block tables do not cover, and blocks past the arrays."""
        totals = batch.total_lengths
        covered = batch.table_lengths * self.block_size
        if (totals > covered).any():
            i = int(np.argmax(totals > covered))
            raise SlotsNotReservedError(
                f"positions up to {int(totals[i])} used but only {int(batch.table_lengths[i])}"
                " blocks reserved: reserve slots before the forward"
            )
        table = batch.block_table
        if table.size and int(table.max()) >= self._capacity_blocks:
            raise SlotsNotReservedError(
                f"block {int(table.max())} is past the arrays' {self._capacity_blocks} blocks:"
                " apply the KV manager's update before the forward"
            )

    def _grow(self, capacity_blocks: int) -> None:
        """Reallocate the per-layer arrays for `capacity_blocks` (+ scratch), keeping data.
        All or nothing: the new arrays replace the old only once every one of them exists, so
        a failed allocation leaves K and V as they were."""
        shape = ((capacity_blocks + 1) * self.block_size, self.kv_heads, self.head_dim)
        used = self._capacity_blocks * self.block_size
        grown: list[list[mx.array]] = []
        for arrays in (self._keys, self._values):
            fresh_arrays = []
            for layer in range(self.num_layers):
                fresh = mx.zeros(shape, dtype=self.dtype)
                if used:
                    fresh[:used] = arrays[layer][:used]
                fresh_arrays.append(fresh)
            mx.eval(fresh_arrays)
            grown.append(fresh_arrays)
        self._keys, self._values = grown
        self._capacity_blocks = capacity_blocks
        release_freed_memory()  # the old arrays: else the process keeps their pages

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer: one gather + one scatter per array.
        The gathered source is evaluated before the scatter: `a[dst] = a[src]` in one lazy
        graph would keep a second reference to the pool and make MLX copy all of it."""
        if not copies:
            return
        size = self.block_size
        offsets = np.arange(size, dtype=np.int32)
        src = mx.array(np.array([s for s, _ in copies], np.int32)[:, None] * size + offsets)
        dst = mx.array(np.array([d for _, d in copies], np.int32)[:, None] * size + offsets)
        src, dst = src.reshape(-1), dst.reshape(-1)
        stores = self._keys + self._values
        blocks = [mx.take(store, src, axis=0) for store in stores]
        mx.eval(blocks)
        for store, block in zip(stores, blocks):
            store[dst] = block  # updates the list's array object: self._keys/_values see it


def unpack_decode_inputs(packed: Any, rows: int) -> tuple[Any, ...]:
    """`PagedKVStorage.decode_inputs`' parts (of the MLX array, or of the NumPy array it is
    built in), each a contiguous view: offsets [rows], lengths [rows], write slots [rows] and
    block tables [rows, W]."""
    width = packed.shape[0] // rows - 3
    return (
        packed[:rows],
        packed[rows : 2 * rows],
        packed[2 * rows : 3 * rows],
        packed[3 * rows :].reshape(rows, width),
    )
