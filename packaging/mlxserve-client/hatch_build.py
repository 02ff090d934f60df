"""Adds the repository's client/ and mlxserve/ packages, and the .proto at its import path
beside the generated code (as grpcio-tools ships its protos), to a built wheel.

Only to a built one: `force-include` in pyproject.toml would copy them into editable installs
as well, where stale copies would shadow the checkout; those get the root on sys.path instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "client": "client",
    "mlxserve": "mlxserve",
    "protos/mlxserve/v1/generation.proto": "mlxserve/v1/generation.proto",
}


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        for source, target in SHIPPED.items():
            path = ROOT / source
            if path.is_dir():
                # Sources only: no bytecode caches from the checkout.
                for file in path.rglob("*"):
                    if file.is_file() and "__pycache__" not in file.parts:
                        relative = file.relative_to(path).as_posix()
                        build_data["force_include"][str(file)] = f"{target}/{relative}"
            else:
                build_data["force_include"][str(path)] = target
