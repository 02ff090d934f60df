"""Acceptance targets for the comparison runs, checked against a run's JSON.

The client's harness reports measurements only; the goals the project holds its sweeps to live
here. A target is checked only when the run measured the levels and peers it names.

    python -m bench.targets bench/out/bench-TIME.json [--kind auto|cpu|gpu]

`python -m bench.compare --targets KIND` checks them at the end of a run and adds them to its
JSON under "targets".
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# ("scaling", C_high, C_low, min gain of ours) | ("ratio", peer, C, min ours/peer).
TARGETS: dict[str, list[tuple[Any, ...]]] = {
    "cpu": [("scaling", 8, 1, 5.0), ("ratio", "mlx-lm", 8, 1.2), ("ratio", "mlx-lm", 16, 1.2)],
    "gpu": [("scaling", 64, 1, 25.0), ("ratio", "mlx-lm", 32, 1.3), ("ratio", "raw", 1, 0.9)],
}
KINDS = ("auto", "cpu", "gpu", "none")


def resolve_kind(kind: str, document: Mapping[str, Any]) -> str:
    """`auto`: gpu for a bfloat16 run, else cpu."""
    if kind != "auto":
        return kind
    meta = document.get("meta", {})
    dtype = meta.get("server_before", {}).get("model_info", {}).get("dtype", "")
    return "gpu" if "bfloat16" in dtype or meta.get("dtype") == "bfloat16" else "cpu"


def target_checks(kind: str, document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The targets of `kind` that the run's table (closed levels, by C) can answer."""
    rows = [row for row in document.get("table", []) if row.get("rate") is None]

    def by_c(key: str) -> dict[int, float]:
        return {row["concurrency"]: row[key] for row in rows if row.get(key)}

    ours = by_c("ours_tokens_per_second")
    checks = []

    def check(label: str, value: float, goal: float) -> None:
        checks.append({"target": f"{label} >= {goal:g}x", "value": value, "met": value >= goal})

    for target in TARGETS.get(kind, []):
        if target[0] == "scaling":
            _, high, low, goal = target
            if ours.get(low) and high in ours:
                check(f"ours C={high} / C={low}", ours[high] / ours[low], goal)
        else:
            _, peer, c, goal = target
            theirs = by_c(f"{peer}_tokens_per_second")
            if theirs.get(c) and c in ours:
                check(f"ours / {peer} at C={c}", ours[c] / theirs[c], goal)
    return checks


def format_checks(kind: str, checks: Sequence[Mapping[str, Any]]) -> str:
    if not checks:
        return f"targets ({kind}): none of them applies to this run's levels and peers"
    lines = [f"targets ({kind}):"]
    for check in checks:
        verdict = "met" if check["met"] else "NOT met"
        lines.append(f"  {check['target']}: {check['value']:.2f}x -> {verdict}")
    return "\n".join(lines)


def annotate(path: Path, kind: str) -> str:
    """Checks the run at `path`, records the checks in it ("targets") and returns their text."""
    document = json.loads(path.read_text())
    kind = resolve_kind(kind, document)
    checks = target_checks(kind, document)
    document["targets"] = {"kind": kind, "checks": checks}
    path.write_text(json.dumps(document, indent=1) + "\n")
    return format_checks(kind, checks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.targets", description=__doc__)
    parser.add_argument("path", type=Path, help="a run's JSON")
    parser.add_argument("--kind", choices=KINDS[:-1], default="auto")
    args = parser.parse_args(argv)
    document = json.loads(args.path.read_text())
    kind = resolve_kind(args.kind, document)
    print(format_checks(kind, target_checks(kind, document)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
