"""The Docker build context: .dockerignore keeps the venv, tools, caches and results out, and
keeps everything Dockerfile.client copies. docker-py's `exclude_paths` lists what a build would
send (Docker's own pattern rules), so no Docker daemon is needed."""

from __future__ import annotations

import re
from pathlib import Path

from docker.utils.build import exclude_paths

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "Dockerfile.client"
# Paths that must never reach the daemon (a file under each is made in the fake tree).
JUNK = (
    ".venv/lib/python3.11/site-packages/mlx/lib/libmlx.so",
    ".git/objects/pack/pack-1.pack",
    ".tools/node_modules/@bufbuild/buf/bin/buf",
    "node_modules/x/index.js",
    "client/__pycache__/cli.cpython-311.pyc",
    "service/core/engine/__pycache__/engine.cpython-311.pyc",
    "mlxserve.egg-info/PKG-INFO",
    ".pytest_cache/v/cache/lastfailed",
    ".ruff_cache/0.6.0/123",
    ".hypothesis/examples/ab/cd",
    "build/lib/client/cli.py",
    "dist/mlxserve-0.1.0-py3-none-any.whl",
    "gen/es/mlxserve/v1/generation_pb.js",
    "bench/out/run.json",
    "bench/results/gpu/sweep.png",
)


def _patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _copied_sources() -> list[str]:
    """The source paths of the Dockerfile's COPY instructions."""
    copies = re.findall(
        r"^COPY\s+(?:--\S+\s+)*(.+?)\s+\S+\s*$", (ROOT / DOCKERFILE).read_text(), re.M
    )
    return [src for sources in copies for src in sources.split()]


def _context(root: Path) -> set[str]:
    return set(exclude_paths(str(root), _patterns(), dockerfile=DOCKERFILE))


def test_junk_stays_out_and_sources_go_in(tmp_path: Path) -> None:
    kept = ("client/cli.py", "client/bench/cli.py", "mlxserve/v1/generation_pb2.py", DOCKERFILE)
    for name in (*JUNK, *kept):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    context = _context(tmp_path)
    assert not [name for name in JUNK if name in context]
    assert set(kept) <= context


def test_the_real_context_has_what_the_dockerfile_copies() -> None:
    context = _context(ROOT)
    assert DOCKERFILE in context
    sources = _copied_sources()
    assert sources == ["mlxserve/", "client/"]
    for source in sources:
        files = {
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / source).rglob("*.py")
            if "__pycache__" not in p.parts
        }
        assert files and files <= context
    assert not [p for p in context if p.split("/")[0] in {".venv", ".git", ".tools"}]
    size = sum((ROOT / p).stat().st_size for p in context if (ROOT / p).is_file())
    assert size < 8 << 20, f"build context is {size / 2**20:.1f} MiB"
