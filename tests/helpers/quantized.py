"""Recording what MLX's quantized matmul is handed (service.core.models.quantized's tests)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import pytest


@contextmanager
def quantized_product_inputs() -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the inputs every `mx.quantized_matmul` call sees inside the block."""
    seen: list[tuple[int, ...]] = []
    product = mx.quantized_matmul

    def recording(x: mx.array, *args, **kwargs) -> mx.array:
        seen.append(tuple(x.shape))
        return product(x, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx, "quantized_matmul", recording)
        yield seen
