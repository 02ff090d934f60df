"""Replacing a loaded model's modules in place, for the platform's faster equivalents (norms,
RoPE, MLPs): the replacement takes the child's name, so weights and adapters still find it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx import nn


def swap_modules(
    model: Any, wanted: Callable[[Any], bool], wrapper: Callable[[Any], nn.Module]
) -> int:
    """Replace every child module held as an attribute (as mlx-lm's blocks hold their norms,
    RoPE and MLP; not an element of a list) for which `wanted` holds by `wrapper(child)`;
    returns how many."""
    wrapped = 0
    for module in model.modules():
        for name, child in list(module.items()):
            if wanted(child):
                module[name] = wrapper(child)
                wrapped += 1
    return wrapped
