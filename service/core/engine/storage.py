"""The one interface the engine has to its KV storage, and the factory that picks the storage.

Three storages implement `KVStorage`: the paged pool (kv_paged; block tables and copies come
from the scheduler's KVCacheManager with each step), dense per-sequence arrays (kv_dense) and
mlx-lm's own caches (kv_native, one sequence per forward). Which one, and how its decode steps
read K/V, is decided once by the engine config (config.py): the engine never asks which
storage it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from service.core.engine.batch_view import StepLayout
from service.core.engine.config import EngineConfig
from service.core.engine.kv_dense import DenseKVStorage
from service.core.engine.kv_native import NativeCacheStorage
from service.core.engine.kv_paged import PagedKVStorage
from service.core.engine.state_store import StepStates
from service.core.kv.block_pool import BlockUpdate
from service.core.models.layout import CacheLayout


class KVStorage(Protocol):
    """Where sequences' K/V live, as the engine uses it."""

    name: str  # "paged", "dense" or "native" (EngineConfig.storage)
    bytes_per_token: int  # 0 when unknown ahead (native caches size themselves)

    @property
    def reserved_bytes(self) -> int:
        """K/V memory allocated now."""
        ...

    @property
    def live_sequences(self) -> int: ...

    def new_sequence(self) -> Any:
        """A fresh sequence's handle (what StepLayout.handles holds)."""
        ...

    def release(self, handle: Any) -> None: ...

    def decode_order(self, slots: np.ndarray) -> np.ndarray:
        """The order a decode forward runs these rows in (the storage may prefer its own)."""
        ...

    def apply(self, update: BlockUpdate) -> None:
        """Before a forward: what the scheduler's KV manager changed (growth, block copies)."""
        ...

    def views(
        self,
        layout: StepLayout,
        cache: CacheLayout,
        states: StepStates | None,
        grouped_mask: bool,
        gather: bool = False,
        prompt: bool = False,
    ) -> list[Any]:
        """The cache objects the model's forward takes for this step. `gather`: read K/V the
        plain way even for a decode step (a verification forward); `prompt`: the forward feeds
        prompt tokens (one a row, it still is no decode step for a storage's own copies)."""
        ...

    def end_forward(self) -> None:
        """A forward's layers are built: raises if a write it held for later was never made."""
        ...


@dataclass(frozen=True)
class PoolShape:
    """The paged pool's size, fixed at start-up (the runtime derives it from the budget)."""

    num_blocks: int
    block_size: int = 16
    initial_blocks: int = 64  # physical blocks before the first growth


def make_storage(
    config: EngineConfig, model: Any, cache: CacheLayout, pool: PoolShape | None = None
) -> KVStorage:
    """The storage `config.storage` names, set up for the config's decode path. `pool`: the
    paged pool's shape (paged storage only)."""
    layers = max(1, cache.num_attention)
    if config.storage == "native":
        return NativeCacheStorage(model)
    if config.storage == "dense":
        return DenseKVStorage(layers, cache.kv_heads, cache.head_dim, cache.kv_dtype)
    if pool is None:
        raise ValueError("paged storage needs a pool shape")
    return PagedKVStorage(
        layers,
        cache.kv_heads,
        cache.head_dim,
        cache.kv_dtype,
        pool.num_blocks,
        pool.block_size,
        pool.initial_blocks,
        decode_attention=config.decode_attention,
        in_place=config.in_place_writes,
        mirror_attends=config.fast_mirror_attention,
        rope_in_kernels=config.rope_in_kernels,
    )


def bytes_per_block(cache: CacheLayout, block_size: int) -> int:
    """One paged block's K and V over every attention layer."""
    layers = max(1, cache.num_attention)
    return block_size * 2 * layers * cache.kv_heads * cache.head_dim * cache.kv_dtype.size
