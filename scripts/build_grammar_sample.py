"""Build the seeded corpus sample vendored in tests/data/structured_output/ (see its
PROVENANCE.md for the sources, their commits and licenses).

    python scripts/build_grammar_sample.py --jsb DIR --jsts DIR --out tests/data/structured_output

`--jsb`: guidance-ai/jsonschemabench extracted; `--jsts`: json-schema-org/JSON-Schema-Test-Suite
extracted (`git --git-dir=<mirror> archive HEAD | tar -x`). The selection depends only on the
files' names and contents, never on the filesystem's order: the same inputs give byte-identical
output. PROVENANCE.md is written by hand (it records the commits and licenses).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Any


def dumps(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False, separators=(",", ":"), sort_keys=False)


def category(name: str) -> str:
    return name.split("---")[0] if "---" in name else name.rsplit("_", 1)[0]


def rng_for(seed: int, label: str) -> random.Random:
    # One stream per category: adding a category never reshuffles the others.
    return random.Random(int(hashlib.sha256(f"{seed}:{label}".encode()).hexdigest()[:16], 16))


def sample_jsb(
    root: Path, seed: int, k: int, max_bytes: int, max_valid: int, max_invalid: int
) -> list[dict[str, Any]]:
    by: dict[str, list[tuple[str, dict, int, bool]]] = {}
    for p in sorted((root / "maskbench" / "data").glob("*.json")):
        d = json.loads(p.read_text())
        tests = d.get("tests", [])
        if not any(t["valid"] for t in tests):
            continue
        both = any(not t["valid"] for t in tests)
        by.setdefault(category(p.name), []).append((p.stem, d, len(dumps(d["schema"])), both))
    out = []
    for cat in sorted(by):
        items = by[cat]
        if any(it[3] for it in items):  # schemas with invalid instances too, where there are
            items = [it for it in items if it[3]]
        small = [it for it in items if it[2] <= max_bytes]
        if len(small) < k:  # e.g. Github_ultra: a few of its smallest instead
            small = sorted(items, key=lambda it: (it[2], it[0]))[: max(k, 1) * 2]
            small = small[: max(1, k // 3)]
        pick = rng_for(seed, cat).sample(small, min(k, len(small)))
        for name, d, *_ in sorted(pick, key=lambda it: it[0]):
            valid = [t for t in d["tests"] if t["valid"]][:max_valid]
            invalid = [t for t in d["tests"] if not t["valid"]][:max_invalid]
            tests = [{"valid": t["valid"], "data": t["data"]} for t in valid + invalid]
            out.append({"id": name, "category": cat, "schema": d["schema"], "tests": tests})
    return out


def sample_jsts(root: Path, seed: int, draft: str, per_file: int) -> list[dict[str, Any]]:
    out = []
    for p in sorted((root / "tests" / draft).glob("*.json")):  # required keywords only
        groups = json.loads(p.read_text())
        # Remote $refs need the suite's own HTTP server.
        usable = [
            (i, g) for i, g in enumerate(groups) if "localhost:1234" not in dumps(g["schema"])
        ]
        pick = rng_for(seed, f"{draft}/{p.stem}").sample(usable, min(per_file, len(usable)))
        for i, g in sorted(pick, key=lambda x: x[0]):
            tests = [
                {"valid": t["valid"], "description": t["description"], "data": t["data"]}
                for t in g["tests"]
            ]
            out.append(
                {
                    "id": f"{draft}/{p.stem}#{i}",
                    "keyword": p.stem,
                    "description": g["description"],
                    "schema": g["schema"],
                    "tests": tests,
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jsb", type=Path, required=True)
    ap.add_argument("--jsts", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("tests/data/structured_output"))
    ap.add_argument("--seed", type=int, default=20260101)
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-bytes", type=int, default=4000, help="largest schema (minified)")
    ap.add_argument("--max-valid", type=int, default=2)
    ap.add_argument("--max-invalid", type=int, default=3)
    ap.add_argument("--draft", default="draft2020-12")
    ap.add_argument("--per-file", type=int, default=2, help="test groups per keyword file")
    ap.add_argument("--budget", type=int, default=350_000, help="refuse a bigger sample")
    a = ap.parse_args()
    jsb = sample_jsb(a.jsb, a.seed, a.per_category, a.max_bytes, a.max_valid, a.max_invalid)
    jsts = sample_jsts(a.jsts, a.seed, a.draft, a.per_file)
    files = {
        "jsonschemabench.json": "[\n" + ",\n".join(dumps(x) for x in jsb) + "\n]\n",
        "json_schema_test_suite.json": "[\n" + ",\n".join(dumps(x) for x in jsts) + "\n]\n",
    }
    total = sum(len(text.encode()) for text in files.values())
    if total > a.budget:
        raise SystemExit(f"the sample is {total} bytes, over the {a.budget}-byte budget")
    a.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (a.out / name).write_text(text)
    cats: dict[str, int] = {}
    for x in jsb:
        cats[x["category"]] = cats.get(x["category"], 0) + 1
    print(
        f"{len(jsb)} JSONSchemaBench schemas ({sum(len(x['tests']) for x in jsb)} instances), "
        f"{len(jsts)} test-suite groups ({sum(len(x['tests']) for x in jsts)} instances), "
        f"{total} bytes"
    )
    print("per category: " + ", ".join(f"{c} {n}" for c, n in sorted(cats.items())))


if __name__ == "__main__":
    main()
