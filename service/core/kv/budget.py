"""The KV cache budget: how many bytes the block pool may hold (`--kv-cache-budget`)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

GIB = 1 << 30
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class BudgetError(ValueError):
    pass


def available_memory_bytes() -> int:
    """Memory the process could still take: the device's working set on a GPU, else the
    host's MemAvailable (Linux) — on CPU the KV cache lives in host memory."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if key in info and mx.default_device() != mx.cpu:
            return int(info[key]) - int(mx.get_active_memory())
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


def auto_budget(weights_bytes: int, *, available: int | None = None) -> int:
    """Free memory minus the weights (if not already loaded) and an activation headroom."""
    free = available_memory_bytes() if available is None else available
    headroom = max(GIB, free // 10)
    return max(0, free - headroom - max(0, weights_bytes - int(mx.get_active_memory())))


def parse_budget(value: str, weights_bytes: int) -> int | None:
    """Bytes for the pool, or None for unlimited (`none`/0)."""
    text = value.strip().lower()
    if text in ("none", "0", "unlimited"):
        return None
    if text == "auto":
        return auto_budget(weights_bytes)
    match = _SIZE.fullmatch(text)
    if match is None:
        raise BudgetError(
            f"--kv-cache-budget {value!r}: use auto, none, or a size like 600000000 or 600M"
        )
    number = float(match.group(1)) * _UNITS[match.group(2) or ""]
    return int(number) or None
