"""The checked-in stubs are what `make proto` generates, and the API passes buf's STANDARD lint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO = "mlxserve/v1/generation.proto"
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "protos" / PROTO),
        ],
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "mlxserve" / "v1" / name).read_text()
        checked_in = (ROOT / "mlxserve" / "v1" / name).read_text()
        assert fresh == checked_in, f"mlxserve/v1/{name} is stale: run `make proto`"


def test_stream_request_mirrors_generate_request() -> None:
    from mlxserve.v1 import generation_pb2 as pb

    def shape(descriptor):
        return [
            (f.name, f.number, f.type, f.message_type and f.message_type.full_name)
            for f in descriptor.fields
        ]

    assert shape(pb.GenerateRequest.DESCRIPTOR) == shape(pb.StreamGenerateRequest.DESCRIPTOR)


def _buf() -> str | None:
    local = ROOT / ".tools" / "node_modules" / ".bin" / "buf"
    return str(local) if local.exists() else shutil.which("buf")


@pytest.mark.skipif(_buf() is None, reason="buf is not installed (make install brings it via npm)")
def test_buf_lint_standard() -> None:
    result = subprocess.run([_buf(), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
