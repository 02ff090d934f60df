"""bench/shapes.py: a configuration's projection shapes."""

from __future__ import annotations

from bench.shapes import projections
from service.core.models.presets import preset_config


def test_grouped_heads_and_an_explicit_head_dim() -> None:
    smollm2 = projections(preset_config("smollm2-135m"))  # 9 heads of 64, 3 K/V heads
    assert smollm2 == {
        "q": (576, 576),
        "k": (576, 192),
        "v": (576, 192),
        "o": (576, 576),
        "gate": (576, 1536),
        "up": (576, 1536),
        "down": (1536, 576),
    }
    cfg = dict(hidden_size=64, num_attention_heads=4, head_dim=32, intermediate_size=96)
    shapes = projections(cfg)  # no K/V head count: every head its own
    assert shapes["q"] == shapes["k"] == (64, 128) and shapes["o"] == (128, 64)
