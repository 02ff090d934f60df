"""mlx-lm's own cache objects, one list per sequence: for a model whose caches our views cannot
serve (service.core.models.layout's `native` layouts, e.g. chunked attention).

Such a model runs one sequence per forward, exactly as mlx-lm runs it alone (the scheduler
prefills a prompt's last token in a forward of its own, as mlx-lm does: `PrefillPlan.
last_alone`), and the server clamps its batch to one row. The caches append in place, so a
forward is never redone: a failed row ends instead of being retried.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from service.core.engine.batch_view import StepLayout
from service.core.engine.state_store import StepStates
from service.core.kv.block_pool import BlockUpdate
from service.core.models.layout import CacheLayout


class NativeCacheStorage:
    name = "native"
    bytes_per_token = 0  # unknown ahead: the caches size themselves

    def __init__(self, model: Any) -> None:
        self._model = model
        self._live: dict[int, list[Any]] = {}

    def new_sequence(self) -> list[Any]:
        caches = make_prompt_cache(self._model)
        self._live[id(caches)] = caches
        return caches

    def release(self, caches: list[Any]) -> None:
        self._live.pop(id(caches), None)

    def decode_order(self, slots: np.ndarray) -> np.ndarray:
        return slots

    def apply(self, update: BlockUpdate) -> None:
        pass  # no blocks: mlx-lm's caches grow as they are written

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
        """The one row's own caches (they hold every position written so far)."""
        if layout.batch_size != 1 or layout.padded:
            raise ValueError("mlx-lm's own caches serve one unpadded row per forward")
        return layout.handles[0]

    @property
    def live_sequences(self) -> int:
        return len(self._live)

    @property
    def reserved_bytes(self) -> int:
        return sum(c.nbytes for caches in self._live.values() for c in caches if not c.empty())
