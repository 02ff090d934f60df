"""A model configuration's projection shapes, for benchmarks that build layers of its widths
(no MLX import: client-side harnesses use it too)."""

from __future__ import annotations

from typing import Any

ATTENTION = ("q", "k", "v", "o")


def projections(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a llama-style layer: q, k, v, o, gate, up, down."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q = heads * head_dim
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim
    inter = cfg["intermediate_size"]
    return {
        "q": (hidden, q),
        "k": (hidden, kv),
        "v": (hidden, kv),
        "o": (q, hidden),
        "gate": (hidden, inter),
        "up": (hidden, inter),
        "down": (inter, hidden),
    }
