"""mlx-lm's own cache objects, one list per sequence: for a model whose caches our views cannot
serve (service.models.layout's `native` layouts, e.g. chunked attention).

Such a model runs one sequence per forward, exactly as mlx-lm runs it alone, and the server
clamps its batch to one row. The caches append in place, so a forward is never redone: a
failed row ends instead of being retried.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from service.engine.batch_view import StepLayout


class NativeCacheStorage:
    name = "native"
    bytes_per_token = 0  # unknown ahead: the caches size themselves

    def __init__(self, model: Any) -> None:
        self._model = model
        self._live: dict[int, list[Any]] = {}

    def new_sequence(self, cache_prefix: bool = True) -> list[Any]:
        caches = make_prompt_cache(self._model)
        self._live[id(caches)] = caches
        return caches

    def release(self, caches: list[Any]) -> None:
        self._live.pop(id(caches), None)

    def views(self, batch: StepLayout) -> list[Any]:
        """The one row's own caches (they hold every position written so far)."""
        if batch.batch_size != 1 or batch.padded:
            raise ValueError("mlx-lm's own caches serve one unpadded row per forward")
        return batch.handles[0]

    def write_and_gather(self, layer: int, batch: StepLayout, keys: Any, values: Any):
        raise NotImplementedError("native caches are written by the model itself")

    @property
    def live_sequences(self) -> int:
        return len(self._live)

    @property
    def reserved_bytes(self) -> int:
        return sum(c.nbytes for caches in self._live.values() for c in caches if not c.empty())

    # The paged pool's bookkeeping, for a storage that has none.
    def adopt_prefix(self, caches: list[Any], token_ids: object) -> int:
        return 0

    def commit_tokens(self, caches: list[Any], token_ids: object) -> int:
        return 0

    def blocks_needed(self, caches: list[Any], num_tokens: int) -> int:
        return 0

    def ensure_reserved(self, caches: list[Any], num_tokens: int) -> bool:
        return True

    def free_blocks(self) -> None:
        return None

    def capacity_tokens(self) -> None:
        return None
