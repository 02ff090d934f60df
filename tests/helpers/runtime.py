"""An engine core's Runtime loaded in-process on a dummy preset (no loop thread, no gRPC)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from service.common.config import CoreConfig, ModelConfig, SchedulingConfig
from service.core.runtime import Runtime


@contextmanager
def loaded_runtime(preset: str = "tiny", max_batch_size: int = 2) -> Iterator[Runtime]:
    """The preset's random weights loaded (the dummy presets take the embedded model's
    tokenizer: mark the test `model`), shut down on exit."""
    runtime = Runtime(
        CoreConfig(
            model=ModelConfig(load_format=f"dummy:{preset}"),
            scheduling=SchedulingConfig(max_batch_size=max_batch_size),
        )
    )
    runtime.load()
    try:
        yield runtime
    finally:
        runtime.shutdown()
