"""What a benchmark writes: its arguments and figures as one JSON file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def write_json(path: Path | None, args: argparse.Namespace, **figures: Any) -> None:
    """`{"args": ..., **figures}` to path (its directory made), the arguments as strings; no
    path: nothing."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"args": {k: str(v) for k, v in vars(args).items()}, **figures}
    path.write_text(json.dumps(body, indent=1))
    print(f"wrote {path}")
