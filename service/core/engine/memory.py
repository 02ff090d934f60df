"""Give memory that was freed back to the operating system.

MLX's CPU buffers come from the C library's malloc. When the paged pool grows, its old arrays
are freed, but glibc keeps freed heap memory mapped for reuse (the process's RSS keeps it);
`malloc_trim` hands the free pages back. MLX's own buffer cache is cleared first so that what
it holds is freed too. Growth is rare (the pool doubles), so this is cheap where it is called.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

import mlx.core as mx


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return None


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    mx.clear_cache()
    if _TRIM is not None:
        _TRIM(0)
