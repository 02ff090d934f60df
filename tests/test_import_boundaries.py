"""The process split, as the imports show it: a front end never loads MLX nor the engine core's
modules; what crosses the boundary imports neither MLX nor gRPC."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import REPO_ROOT

# Each test starts an interpreter that imports the service's modules.
pytestmark = pytest.mark.slow

MLX = ("mlx", "mlx_lm")
CORE_ONLY = (
    "service.core.scheduler",
    "service.core.kv",
    "service.core.engine",
    "service.core.models",
)


def _loaded_after(*modules: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    code = (
        "import importlib, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        "print('\\n'.join(sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def test_front_end_loads_no_mlx_and_no_core() -> None:
    loaded = _loaded_after(
        "service.frontend.server", "service.frontend.servicer", "service.launcher"
    )
    leaked = sorted(m for m in loaded if m.split(".")[0] in MLX or m.startswith(CORE_ONLY))
    assert "service.frontend.server" in loaded
    assert leaked == []


def test_protocol_imports_neither_mlx_nor_grpc() -> None:
    loaded = _loaded_after("service.protocol")
    assert sorted(m for m in loaded if m.split(".")[0] in (*MLX, "grpc")) == []
