"""bench/report.py: a benchmark's JSON file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.report import write_json


def test_the_file_holds_the_arguments_as_text_and_the_figures(tmp_path: Path) -> None:
    args = argparse.Namespace(rows=64, out=tmp_path / "deep" / "r.json")
    write_json(args.out, args, step_ms={"base": [1.5, 2.0]})
    body = json.loads(args.out.read_text())
    assert body == {
        "args": {"rows": "64", "out": str(args.out)},
        "step_ms": {"base": [1.5, 2.0]},
    }
