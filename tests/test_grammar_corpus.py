"""The grammar engine against public corpora (the seeded sample in tests/data/structured_output,
PROVENANCE.md there): each instance is force-fed through the matcher path as the engine core
runs it (every token must be in the mask and accepted, EOS allowed at the end).

- JSONSchemaBench (MaskBench's method): a schema passes when it compiles, every valid instance
  goes through and every invalid one is refused somewhere. Soundness and completeness are
  strict for the schemas that compile; coverage (schemas that pass) is reported per category
  beside the published figures and held above a floor.
- JSON-Schema-Test-Suite draft 2020-12: no invalid instance of a compiled schema is accepted;
  refused valid instances (properties in an order other than the schema's, 1.0 for 1) are
  counted, not failed.

Run with `-s` for the table."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from service.common.grammar import GrammarCache, GrammarError
from tests.helpers.grammar import corpus, dump, embedded_tokenizer, engine_cache, feed
from tests.helpers.grammar import schema_format as fmt

pytestmark = pytest.mark.model

# MaskBench coverage as published (JSONSchemaBench, arXiv:2501.10868, and llguidance's
# MaskBench table): schemas passing, all categories.
PUBLISHED = {"llguidance 0.7.10": 0.79, "XGrammar 0.1.17": 0.72}
# What this sample must keep passing: a drop means the engine or our options changed.
MIN_PASSING = 0.80


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return engine_cache(max_entries=512)


def _run(cache: GrammarCache, case: dict[str, Any]) -> tuple[str, list[str]]:
    """(outcome, problems): outcome is passing, refused (did not compile) or failing."""
    tok = embedded_tokenizer()
    try:
        compiled = cache.compile(fmt(case["schema"]))
    except GrammarError as exc:
        assert exc.reason and exc.code in ("invalid", "unsupported", "too_complex", "timeout")
        return "refused", []
    problems = []
    for i, test in enumerate(case["tests"]):
        ok, why = feed(compiled, tok.encode(dump(test["data"])))
        if test["valid"] and not ok:
            problems.append(f"{case['id']}: valid instance #{i} refused: {why}")
        if not test["valid"] and ok:
            problems.append(f"{case['id']}: invalid instance #{i} accepted")
    return ("failing" if problems else "passing"), problems


def test_jsonschemabench_sample(cache: GrammarCache) -> None:
    by_category: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    problems: list[str] = []
    for case in corpus("jsonschemabench.json"):
        outcome, found = _run(cache, case)
        by_category[case["category"]][outcome] += 1
        problems += found
    total = defaultdict(int)
    lines = ["", "| category | schemas | compiled | passing |", "|---|---:|---:|---:|"]
    for category in sorted(by_category):
        counts = by_category[category]
        n = sum(counts.values())
        for key, value in counts.items():
            total[key] += value
        compiled = n - counts["refused"]
        lines.append(f"| {category} | {n} | {compiled} | {counts['passing']} |")
    n = sum(total.values())
    passing = total["passing"] / n
    lines.append(f"| all | {n} | {n - total['refused']} | {total['passing']} ({passing:.0%}) |")
    lines.append("published, MaskBench: " + ", ".join(f"{k} {v:.0%}" for k, v in PUBLISHED.items()))
    print("\n".join(lines))
    assert problems == []
    assert passing >= MIN_PASSING


def test_json_schema_test_suite_sample(cache: GrammarCache) -> None:
    tok = embedded_tokenizer()
    groups = corpus("json_schema_test_suite.json")
    compiled_groups = refused_valid = valid = 0
    accepted_invalid = []
    for group in groups:
        try:
            compiled = cache.compile(fmt(group["schema"]))
        except GrammarError as exc:
            assert exc.reason
            continue
        compiled_groups += 1
        for test in group["tests"]:
            ok, _ = feed(compiled, tok.encode(dump(test["data"])))
            if test["valid"]:
                valid += 1
                refused_valid += not ok
            elif ok:
                accepted_invalid.append(f"{group['id']}: {test['description']}")
    print(
        f"\ndraft 2020-12: {compiled_groups}/{len(groups)} groups compiled; "
        f"{refused_valid}/{valid} valid instances refused; invalid accepted: {accepted_invalid}"
    )
    assert accepted_invalid == []
    assert compiled_groups >= len(groups) // 2
