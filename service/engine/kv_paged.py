"""Paged KV storage: every sequence's K/V lives in one block pool shared by all sequences.

Per layer there is ONE K and ONE V array of flat slots, `[(num_blocks + 1) * block_size,
kv_heads, head_dim]`; slot `block_id * block_size + offset` holds one token position. The
bookkeeping (block tables, ref counts, prefix cache, copy-on-write) is `KVCacheManager`'s; this
module moves the bytes. The last physical block is a scratch block the pool never hands out:
padding positions of a ragged step are written there and padding reads come from there.

A step costs, per layer, one scatter of the new tokens' K/V into the pool and one take of every
row's positions 0..end into a `[B, kv_heads, T, head_dim]` array (right-padded; the BatchView
mask hides the padding). Slot indices are computed once per step on the CPU and reused by all
layers. The scatter updates the pool in place only while nothing else references the pool's
buffer when the step is dispatched: see `write_and_gather`. A decode step can instead attend
over the storage's decode mirror (`configure`, service.engine.kv_mirror), a contiguous copy
of the batch that it appends to, or read the pool directly (`attend`, the CUDA kernel).

Block reservation is not done while the model runs: the engine (or the scheduler, ahead of
time) calls `reserve` / `ensure_reserved` before building a forward, and a sequence whose prompt
starts with cached full blocks adopts them with `adopt_prefix` and prefills only the rest.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx
import numpy as np

from service.engine.batch_view import StepLayout
from service.engine.kv_mirror import DecodeMirror, MirrorStep, slot_head_rows
from service.engine.memory import release_freed_memory
from service.engine.paged_attention import kernel_meta, paged_decode_attention, store_decode_kv
from service.kv.block_pool import KVCacheManager, KVCacheStats, SequenceBlocks

MIRROR_MAX_BYTES = 1 << 30  # past this (big batch x long rows), decode steps gather instead


class OutOfBlocksError(RuntimeError):
    """The pool has no free block for a reservation (after evicting cold cached prefixes)."""


@dataclass(eq=False)
class PagedSequenceKV:
    """One sequence's handle: its block table in the shared pool."""

    blocks: SequenceBlocks
    slot_cache: tuple[tuple[int, ...], np.ndarray] | None = None  # (block table, its slots)

    @property
    def num_reserved(self) -> int:
        """Token positions that have a slot (written or reserved ahead)."""
        return self.blocks.num_tokens

    @property
    def block_ids(self) -> list[int]:
        return self.blocks.block_ids


@dataclass
class _StepPlan:
    """One step's slot indices (host arrays), turned into device arrays on first use: a
    gathering step reads `read`, a direct decode step `slots` and `lengths`."""

    write: mx.array  # [B * N] slot of each new token position (padding -> scratch slot)
    slot_table: np.ndarray  # [B, T] slot of each position (padding -> scratch slot)
    totals: list[int]  # positions each row attends to
    kv_heads: int
    written: dict[int, mx.array] = field(default_factory=dict)  # layer -> its in-place write
    metas: dict[int | None, mx.array] = field(default_factory=dict)

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

    def meta(self, window: int | None) -> mx.array:
        """The decode kernel's `meta` for a layer of this window (made once per step each)."""
        if window not in self.metas:
            self.metas[window] = kernel_meta(self.slot_table.shape[1], window)
        return self.metas[window]


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
        enable_prefix_caching: bool = True,
        initial_blocks: int = 64,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a paged pool needs at least one block, got {num_blocks}")
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.manager = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching, capacity=min(num_blocks, initial_blocks)
        )
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * dtype.size
        self.bytes_per_block = block_size * self.bytes_per_token
        # The budget fixes the logical pool; the physical arrays cover the pool's `capacity`,
        # which it raises only when every block below it is in use, so an `auto` budget of
        # many GiB costs nothing until that many blocks are live at once. The physical block
        # after the last one is the scratch block.
        self._capacity_blocks = 0
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._ensure_physical()
        self._live: set[int] = set()
        self._plan_layout: weakref.ref[StepLayout] | None = None
        self._plan: _StepPlan | None = None
        self._plan_layer = 0  # the last layer that asked for the plan
        # Set once by the engine that owns the storage (`configure`), from its EngineConfig.
        self.mirror: DecodeMirror | None = None
        self.write_in_place = False

    def configure(self, in_place: bool, mirror: bool) -> None:
        """in_place: decode steps write their K/V with the in-place CUDA kernel
        (`store_decode_kv`), so steps can overlap; mirror: decode steps attend over a
        contiguous copy of the batch (service.engine.kv_mirror)."""
        self.write_in_place = in_place
        self.mirror = DecodeMirror(MIRROR_MAX_BYTES) if mirror else None

    # -- sequences -------------------------------------------------------------------
    def new_sequence(self, cache_prefix: bool = True) -> PagedSequenceKV:
        handle = PagedSequenceKV(self.manager.new_sequence(cache_prefix=cache_prefix))
        self._live.add(id(handle))
        return handle

    def truncate(self, handle: PagedSequenceKV, num_tokens: int) -> None:
        """Keep slots for the first num_tokens positions only (rejected draft tokens): the
        blocks past them go back to the pool."""
        if num_tokens < handle.blocks.num_tokens:
            self.manager.truncate(handle.blocks, num_tokens)

    def release(self, handle: PagedSequenceKV) -> None:
        """Free the sequence's blocks; registered full blocks stay cached (evictable, LRU)."""
        self.manager.free_sequence(handle.blocks)
        self._live.discard(id(handle))
        if self.mirror is not None and any(h is handle for h in self.mirror.handles):
            self.mirror.clear()  # the batch changed: free the copy now, rebuild when needed

    def fork(self, handle: PagedSequenceKV) -> PagedSequenceKV:
        """A child sharing all of handle's blocks; whichever writes a shared block copies it."""
        child = PagedSequenceKV(self.manager.fork(handle.blocks))
        self._live.add(id(child))
        return child

    def reserve(self, handle: PagedSequenceKV, num_new_tokens: int) -> bool:
        """Reserve slots for num_new_tokens positions past those already reserved. All or
        nothing: False (out of blocks, after evicting cold prefixes) changes nothing. Shared
        blocks in the range are copied on write here, for every layer."""
        blocks = handle.blocks
        held = len(blocks.block_ids)
        if not self.manager.allocate_slots(blocks, num_new_tokens):
            return False
        if len(blocks.block_ids) != held or blocks.pending_copies:  # new or copied blocks
            self._ensure_physical()
            self._apply_copies(blocks.take_pending_copies())
        return True

    def ensure_reserved(self, handle: PagedSequenceKV, num_tokens: int) -> bool:
        """Idempotent form of reserve: make positions 0..num_tokens-1 have slots. The engine
        calls this before each forward, so a scheduler that reserved ahead costs nothing."""
        missing = num_tokens - handle.blocks.num_tokens
        return True if missing <= 0 else self.reserve(handle, missing)

    def blocks_needed(self, handle: PagedSequenceKV, num_tokens: int) -> int:
        """New blocks positions 0..num_tokens-1 would take beyond those reserved."""
        missing = num_tokens - handle.blocks.num_tokens
        return handle.blocks.blocks_needed(missing) if missing > 0 else 0

    def free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-free ones included)."""
        return self.manager.pool.num_free_blocks

    def capacity_tokens(self) -> int:
        """The most tokens one sequence could ever hold: the whole pool."""
        return self.num_blocks * self.block_size

    def can_reserve(self, handle: PagedSequenceKV, num_new_tokens: int) -> bool:
        needed = self.manager.blocks_required(handle.blocks, num_new_tokens)
        return self.manager.pool.can_allocate(needed)

    def adopt_prefix(self, handle: PagedSequenceKV, token_ids: Sequence[int]) -> int:
        """Adopt the cached full blocks that start token_ids (an empty sequence only); returns
        how many tokens they cover: prefill starts at that position. Never fails for lack of
        blocks: adopted blocks are held or free already, and nothing new is allocated."""
        if handle.blocks.block_ids or handle.blocks.num_tokens:
            raise ValueError("only an empty sequence can adopt a cached prefix")
        prefix = self.manager.match_prefix(token_ids)
        if not prefix or not self.manager.allocate_slots(handle.blocks, 0, prefix):
            return 0
        return len(prefix) * self.block_size

    def commit_tokens(self, handle: PagedSequenceKV, token_ids: Sequence[int]) -> int:
        """Register the sequence's full blocks in the prefix cache; token_ids are the tokens
        whose K/V has been computed (prompt + generated so far). Returns new cache entries."""
        return self.manager.register_full_blocks(handle.blocks, token_ids)

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
    def budget_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def scratch_slot(self) -> int:
        return self._capacity_blocks * self.block_size

    @property
    def num_slots(self) -> int:
        return (self._capacity_blocks + 1) * self.block_size

    @property
    def used_bytes(self) -> int:
        return self.manager.pool.num_active_blocks * self.bytes_per_block

    def stats(self) -> KVCacheStats:
        return self.manager.stats()

    # -- the forward -----------------------------------------------------------------
    def write(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """A direct decode step's write (`attend` reads the pool next): the rows' new K/V
        ([B, kv_heads, 1, head_dim]) into their slots; returns the layer's pool arrays. With
        `write_in_place` this is the in-place CUDA kernel, whose result orders this layer's
        `attend` after it; otherwise `_scatter`."""
        if not (self.write_in_place and batch.width == 1):
            return self._scatter(layer, batch, keys, values)
        plan = self._step_plan(layer, batch)
        k_store, v_store = self._keys[layer], self._values[layer]
        plan.written[layer] = store_decode_kv(k_store, v_store, keys, values, plan.write)
        return k_store, v_store

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
        # a contiguous operand; taking [B, T] slots and transposing the result measured 3x
        # slower in the CPU attention (a strided K/V view).
        k_rows, v_rows = self.pool_rows(layer)
        return mx.take(k_rows, plan.read, axis=0), mx.take(v_rows, plan.read, axis=0)

    def begin_mirrored_step(self, batch: StepLayout) -> MirrorStep | None:
        """For a decode step: bring the mirror up to date; None when there is no mirror or
        the batch would not fit its byte limit (the step gathers instead)."""
        return self.mirror.begin_step(self, batch) if self.mirror is not None else None

    def write_mirrored(
        self, layer: int, batch: StepLayout, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """`_scatter`, then append to the mirror; returns views of the mirror up to this step."""
        self._scatter(layer, batch, keys, values)
        assert self.mirror is not None
        return self.mirror.append(layer, keys, values)

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
    ) -> mx.array:
        """Decode attention of the step's rows read through their slots (after `write`), over
        their last `window` positions for a sliding-window layer."""
        plan = self._step_plan(layer, batch)
        return paged_decode_attention(
            queries,
            k_pool,
            v_pool,
            plan.slots,
            plan.lengths,
            scale,
            plan.meta(window),
            after=plan.written.get(layer),
            window=window,
        )

    def decode_inputs(self, batch: StepLayout, bucket: int) -> list[mx.array]:
        """A direct decode step's plan as arrays, for a compiled forward (compiled_decode):
        RoPE offsets [B], slots [B, T'] (T' = the span rounded up to `bucket`, padded with
        the scratch slot), lengths [B], write slots [B] and the width T' as a [1] array (the
        compiled graph makes each layer's kernel `meta` from it)."""
        plan = self._step_plan(0, batch)
        b, t = plan.slot_table.shape
        width = -(-t // bucket) * bucket
        slots = np.full((b, width), self.scratch_slot, dtype=np.int32)
        slots[:, :t] = plan.slot_table
        offsets = mx.array(np.asarray(batch.starts, dtype=np.int32))
        span = mx.array([width], dtype=mx.int32)
        return [offsets, mx.array(slots), plan.lengths, plan.write, span]

    def pool_arrays(self) -> list[mx.array]:
        """Every layer's K pool, then every layer's V pool."""
        return [*self._keys, *self._values]

    def gather(self, handle: PagedSequenceKV, layer: int, num_tokens: int) -> tuple[mx.array, ...]:
        """A sequence's first num_tokens K and V of one layer, [kv_heads, num_tokens, head_dim]
        (for tests and debugging)."""
        slots = mx.array(self.slots_of(handle, num_tokens))
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
        self._ensure_physical()  # blocks reserved through the manager directly; moves scratch
        b, n = batch.batch_size, batch.width
        totals = batch.total_lengths
        t = batch.span
        write = np.full((b, n), self.scratch_slot, dtype=np.int32)
        read = np.full((b, t), self.scratch_slot, dtype=np.int32)  # slots, expanded below
        for i, handle in enumerate(batch.handles):
            start, count, end = batch.starts[i], batch.lengths[i], totals[i]
            if end > handle.blocks.num_tokens:
                raise ValueError(
                    f"positions up to {end} written but only {handle.blocks.num_tokens}"
                    " reserved: call reserve()/ensure_reserved() before the forward"
                )
            if handle.blocks.pending_copies:  # reserved through the manager directly
                self._apply_copies(handle.blocks.take_pending_copies())
            slots = self.slots_of(handle, end)
            read[i, :end] = slots
            write[i, :count] = slots[start:end]
        self._plan = _StepPlan(mx.array(write.reshape(-1)), read, totals, self.kv_heads)
        self._plan_layout = weakref.ref(batch)
        return self._plan

    def _ensure_physical(self) -> None:
        """Grow the arrays to the pool's capacity (raised by an allocation that needed it)."""
        if self.manager.pool.capacity > self._capacity_blocks:
            self._grow(self.manager.pool.capacity)

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

    def slots_of(self, handle: PagedSequenceKV, num_tokens: int) -> np.ndarray:
        """Slot of each of the sequence's first num_tokens positions (cached per block table:
        a decode step reuses it until the table changes)."""
        key = tuple(handle.blocks.block_ids)
        if handle.slot_cache is None or handle.slot_cache[0] != key:
            size = self.block_size
            table = np.asarray(key, dtype=np.int32)
            slots = (table[:, None] * size + np.arange(size, dtype=np.int32)).reshape(-1)
            handle.slot_cache = (key, slots)
        return handle.slot_cache[1][:num_tokens]

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
