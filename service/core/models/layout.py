"""What a model keeps per sequence between forwards, read off mlx-lm's own cache objects.

mlx-lm models take `cache=[...]`: one entry per cache-bearing layer, as `model.make_cache()`
builds it (a `KVCache` per layer when the model defines none). The entry's type says what the
layer keeps:

- `KVCache`: full attention. Its K/V go to our paged pool (or dense arrays).
- `RotatingKVCache(max_size=W)`: sliding-window attention over the last W positions. Its K/V
  go to the pool too; the window is applied by the mask (or the decode kernel), not by
  dropping positions, so prefix sharing keeps working.
- `ArraysCache(size=n)`: recurrent state (convolution and SSM / linear-attention state) that
  the layer replaces every forward. It lives per sequence beside the pool
  (service.core.engine.state_store).
- `CacheList(a, b, ...)`: a layer with several of the above (e.g. Falcon-H1's parallel mamba
  and attention).

`probe_layout` runs the model once on two tokens with mlx-lm's own caches and reads the K/V
head count, head size and dtype, and the state arrays' shapes, from what the layers stored:
no per-family knowledge of configuration fields is needed. A model with any other kind of
cache (chunked or quantized KV caches, sink positions kept by `keep`) gets a `native` layout:
it is served one sequence at a time with mlx-lm's own cache objects (service.core.engine.kv_native).
A model whose first forward fails cannot be served at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache


class UnsupportedModelError(RuntimeError):
    """The model keeps per-sequence state in a form the engine cannot serve."""


@dataclass(frozen=True)
class AttentionEntry:
    pool_layer: int  # which of the pool's layers holds this entry's K/V
    window: int | None  # sliding window in positions; None = full attention


@dataclass(frozen=True)
class StateEntry:
    state_layer: int  # which of a sequence's state slots holds this entry's arrays
    shapes: tuple[tuple[int, ...], ...]  # each array's shape without the batch axis
    dtypes: tuple[mx.Dtype, ...]

    @property
    def nbytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            size = dtype.size
            for n in shape:
                size *= n
            total += size
        return total


@dataclass(frozen=True)
class ListEntry:
    children: tuple[AttentionEntry | StateEntry, ...]


Entry = AttentionEntry | StateEntry | ListEntry


@dataclass(frozen=True)
class CacheLayout:
    entries: tuple[Entry, ...]
    num_attention: int
    kv_heads: int
    head_dim: int
    kv_dtype: mx.Dtype
    states: tuple[StateEntry, ...] = ()
    # Why our views cannot serve this model's caches ("" when they can): then it runs one
    # sequence at a time on mlx-lm's own caches.
    native_reason: str = ""

    @property
    def native(self) -> bool:
        return bool(self.native_reason)

    @property
    def stateful(self) -> bool:
        """Some layer keeps recurrent state: a forward of several tokens per row must not be
        padded (padding would run through the recurrence)."""
        return bool(self.states)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The window of each pool layer (None = full attention)."""
        out: list[int | None] = [None] * self.num_attention
        for entry in self.attention_entries():
            out[entry.pool_layer] = entry.window
        return tuple(out)

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def attention_entries(self) -> list[AttentionEntry]:
        out: list[AttentionEntry] = []
        for entry in self.entries:
            children = entry.children if isinstance(entry, ListEntry) else (entry,)
            out.extend(c for c in children if isinstance(c, AttentionEntry))
        return out

    def describe(self) -> str:
        """One word per kind, e.g. "attention x24, sliding(512) x20, state x8"."""
        if self.native:
            return f"mlx-lm's own caches ({self.native_reason})"
        counts: dict[str, int] = {}
        for entry in self.entries:
            children = entry.children if isinstance(entry, ListEntry) else (entry,)
            for c in children:
                if isinstance(c, StateEntry):
                    kind = "state"
                elif c.window is None:
                    kind = "attention"
                else:
                    kind = f"sliding({c.window})"
                counts[kind] = counts.get(kind, 0) + 1
        return ", ".join(f"{k} x{n}" for k, n in counts.items())


def probe_layout(model: Any) -> CacheLayout:
    """Classify the model's cache entries and measure them with one two-token forward."""
    template = mlx_cache.make_prompt_cache(model)
    try:
        model(mx.array([[1, 2]], dtype=mx.int32), cache=template)
    except Exception as exc:
        raise UnsupportedModelError(f"a first forward failed: {exc}") from exc
    counter = {"attention": 0, "state": 0}
    kv_shapes: set[tuple[int, int, Any]] = set()
    states: list[StateEntry] = []

    def classify(c: Any) -> AttentionEntry | StateEntry:
        if type(c) in (mlx_cache.KVCache, mlx_cache.RotatingKVCache):
            if c.keys is None:
                raise UnsupportedModelError("an attention layer stored no K/V on a forward")
            if type(c) is mlx_cache.RotatingKVCache:
                if c.keep:
                    raise UnsupportedModelError(
                        f"a rotating KV cache that keeps {c.keep} sink positions"
                    )
                window: int | None = c.max_size
            else:
                window = None
            _, heads, _, dim = c.keys.shape
            kv_shapes.add((heads, dim, c.keys.dtype))
            entry = AttentionEntry(counter["attention"], window)
            counter["attention"] += 1
            return entry
        if type(c) is mlx_cache.ArraysCache:
            arrays = list(c.cache)
            if any(a is None for a in arrays):
                raise UnsupportedModelError("a recurrent layer left part of its state unset")
            entry = StateEntry(
                counter["state"],
                tuple(tuple(a.shape[1:]) for a in arrays),
                tuple(a.dtype for a in arrays),
            )
            counter["state"] += 1
            states.append(entry)
            return entry
        raise UnsupportedModelError(f"per-layer cache type {type(c).__name__} is not supported")

    entries: list[Entry] = []
    try:
        for c in template:
            if type(c) is mlx_cache.CacheList:
                entries.append(ListEntry(tuple(classify(child) for child in c.caches)))
            else:
                entries.append(classify(c))
        if len(kv_shapes) > 1:
            raise UnsupportedModelError(
                f"attention layers with different K/V shapes {sorted(map(str, kv_shapes))}"
            )
    except UnsupportedModelError as exc:
        return CacheLayout((), 0, 1, 1, mx.float32, native_reason=str(exc))
    if kv_shapes:
        heads, dim, dtype = next(iter(kv_shapes))
    else:  # a pure recurrent model: no pool layers
        heads, dim, dtype = 1, 1, states[0].dtypes[0] if states else mx.float32
    return CacheLayout(
        entries=tuple(entries),
        num_attention=counter["attention"],
        kv_heads=heads,
        head_dim=dim,
        kv_dtype=dtype,
        states=tuple(states),
    )
