"""Whether MLX loads here, said in one line: plain `mlx` on Linux has no backend library, and
the error should name the extra that brings one. Asked before anything else starts."""

from __future__ import annotations

import subprocess
import sys

MLX_BACKEND_HINT = "on Linux, install a backend: pip install 'mlxserve[cpu]' (or 'mlxserve[cuda]')"


def mlx_error() -> str | None:
    """Why MLX cannot load, in one line (plain `mlx` on Linux has no backend library)."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as exc:
        return _cannot_load(str(exc))
    return None


def mlx_error_in_child() -> str | None:
    """mlx_error, asked of a child process: the server's front ends never import MLX, yet a
    missing backend should be the first thing `serve` reports."""
    probe = subprocess.run(
        [sys.executable, "-c", "import mlx.core"], capture_output=True, text=True, check=False
    )
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"]
    return _cannot_load(lines[-1])


def _cannot_load(reason: str) -> str:
    return f"MLX cannot load ({reason}); {MLX_BACKEND_HINT}"
