"""service/common/grammar.py on the embedded model's tokenizer: each kind of format constrains
what it should, a matcher only ever advances over masked tokens, malformed and unsupported
formats are refused with the engine's reason, compiles are cached, deduplicated, bounded in
time and run off the caller's thread, and batch and draft masks equal the one-row ones."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from service.common import grammar
from service.common.grammar import GrammarCache, GrammarError, allocate_bitmask
from service.protocol import ResponseFormat
from tests.helpers.grammar import (
    EOS,
    VOCAB,
    allowed,
    dump,
    embedded_tokenizer,
    engine_cache,
    feed,
    schema_format,
)

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return engine_cache(max_entries=64)


@pytest.fixture(scope="module")
def tok():
    return embedded_tokenizer()


def test_json_schema_accepts_valid_and_rejects_invalid(cache, tok) -> None:
    c = cache.compile(schema_format(PERSON))
    assert feed(c, tok.encode(dump({"name": "Ann", "age": 31, "tags": ["a", "b"]})))[0]
    assert feed(c, tok.encode(dump({"name": "Ann", "age": 31})))[0]
    assert not feed(c, tok.encode(dump({"name": "Ann"})))[0]  # required
    assert not feed(c, tok.encode(dump({"name": "Ann", "age": -1})))[0]  # minimum
    assert not feed(c, tok.encode(dump({"name": "Ann", "age": 1, "x": 1})))[0]  # additional
    assert not feed(c, tok.encode(dump({"name": "Ann", "age": 1, "tags": ["a"] * 4})))[0]
    # Free whitespace is not the default output style.
    assert not feed(c, tok.encode('{"name":"Ann","age":31}'))[0]


def test_eos_only_where_the_grammar_may_end(cache, tok) -> None:
    m = cache.compile(schema_format(PERSON)).matcher()
    row = allocate_bitmask(1, VOCAB)[0]
    for t in tok.encode(dump({"name": "Ann", "age": 31})):
        m.fill_mask(row)
        assert not m.is_accepting() and not allowed(row, EOS)
        assert m.accept(t)
    m.fill_mask(row)
    assert m.is_accepting() and allowed(row, EOS)
    assert m.is_terminated()  # after "}" nothing but EOS
    assert np.unpackbits(row.view(np.uint8)).sum() == 1


def test_rollback_restores_the_state(cache, tok) -> None:
    ids = tok.encode(dump({"name": "Bob", "age": 7, "tags": ["x"]}))
    m = cache.compile(schema_format(PERSON)).matcher()
    rows = allocate_bitmask(2, VOCAB)
    assert m.accept(ids[:10])
    m.fill_mask(rows[0])
    assert m.accept(ids[10:14])
    m.rollback(4)
    assert m.tokens == ids[:10]
    m.fill_mask(rows[1])
    assert np.array_equal(rows[0], rows[1])
    assert m.accept(ids[10:]) and m.is_accepting()


def test_validate_has_no_side_effect_and_a_refused_token_is_permanent(cache, tok) -> None:
    m = cache.compile(schema_format(PERSON)).matcher()
    good = tok.encode('{"name": "A')
    bad = tok.encode('"}')  # closes the object without "age"
    assert len(bad) == 1
    assert m.validate(good + bad) == len(good)
    assert m.accept(good)
    saved = m.copy()
    assert not m.accept(bad)
    assert m.error  # why drafts are validated, never accepted unchecked
    assert saved.accept(tok.encode('", "age": 1}')) and saved.is_accepting()


def test_replay_rebuilds_the_state(cache, tok) -> None:
    c = cache.compile(schema_format(PERSON))
    m = c.matcher()
    assert m.accept(tok.encode(dump({"name": "Zed", "age": 99}))[:9])
    rows = allocate_bitmask(2, VOCAB)
    m.fill_mask(rows[0])
    c.replay(m.tokens).fill_mask(rows[1])
    assert np.array_equal(rows[0], rows[1])


def test_choice_is_exactly_one_option(cache, tok) -> None:
    options = ["yes", "yes!", "no", 'say "hi"\n', "ünï"]
    c = cache.compile(ResponseFormat("choice", options=tuple(options)))
    for s in options:
        assert feed(c, tok.encode(s))[0], s
    for s in ["ye", "nope", "Yes", "yes!!", " no", 'say "hi"']:
        assert not feed(c, tok.encode(s))[0], s
    m = c.matcher()
    # "yes" may end or go on to "yes!".
    assert m.accept(tok.encode("yes")) and m.is_accepting() and not m.is_terminated()
    assert m.accept(tok.encode("!")) and m.is_terminated()


def test_regex_must_match_in_full(cache, tok) -> None:
    c = cache.compile(ResponseFormat("regex", r"[0-9]{3}-[0-9]{4}"))
    assert feed(c, tok.encode("555-1234"))[0]
    for s in ["555-12", "555-12345", "x555-1234"]:
        assert not feed(c, tok.encode(s))[0], s


def test_grammar_in_the_lark_dialect(cache, tok) -> None:
    c = cache.compile(ResponseFormat("grammar", 'start: "sum(" num ("," num)* ")"\nnum: /[0-9]+/'))
    assert feed(c, tok.encode("sum(1,22,333)"))[0]
    assert not feed(c, tok.encode("sum(1,)"))[0]


def test_json_object_is_any_object(cache, tok) -> None:
    c = cache.compile(ResponseFormat("json_object"))
    assert feed(c, tok.encode(dump({"a": [1, 2.5, None, True], "b": {"c": "d"}})))[0]
    assert not feed(c, tok.encode("[1]"))[0]
    assert not feed(c, tok.encode('"x"'))[0]


@pytest.mark.parametrize(
    ("fmt", "code", "words"),
    [
        (ResponseFormat("json_schema", "{not json"), "invalid", "not valid JSON"),
        (ResponseFormat("json_schema", "[1]"), "invalid", "must be a JSON object"),
        (ResponseFormat("json_schema", "false"), "unsupported", "no document"),
        (ResponseFormat("json_schema", '{"type": "strin"}'), "invalid", "strin"),
        (
            ResponseFormat("json_schema", '{"type": "array", "uniqueItems": true}'),
            "unsupported",
            "uniqueItems",
        ),
        (ResponseFormat("json_schema", '{"not": {"type": "null"}}'), "unsupported", "not"),
        (ResponseFormat("json_schema", '{"$ref": "#/$defs/missing"}'), "invalid", "missing"),
        (
            ResponseFormat("json_schema", '{"type": "string", "pattern": "(?<=a)b"}'),
            "unsupported",
            "look-around",
        ),
        (ResponseFormat("regex", "a(b"), "invalid", "unclosed group"),
        (ResponseFormat("regex", ""), "invalid", "empty"),
        (ResponseFormat("grammar", "start: foo"), "invalid", "unknown name"),
        (ResponseFormat("grammar", "start: ("), "invalid", "grammar"),
        (ResponseFormat("choice"), "invalid", "at least one"),
        (ResponseFormat("choice", options=("a", "")), "invalid", "non-empty"),
        (ResponseFormat("xml", "<a/>"), "invalid", "unknown response_format kind"),
    ],
)
def test_refusals_say_why(cache, fmt, code, words) -> None:
    with pytest.raises(GrammarError) as refused:
        cache.compile(fmt)
    assert refused.value.code == code, refused.value.reason
    assert words.lower() in refused.value.reason.lower(), refused.value.reason
    assert "<state>" not in refused.value.reason and "<grammar>" not in refused.value.reason
    hits = cache.stats.hits
    with pytest.raises(GrammarError):
        cache.compile(fmt)  # the refusal is cached
    assert cache.stats.hits == hits + 1


def test_refusals_name_the_field() -> None:
    assert grammar.format_field("json_schema") == "response_format.json_schema"
    assert grammar.format_field("choice") == "response_format.choice.options"


def _heavy_schema(n: int) -> dict:
    return {
        "type": "object",
        "properties": {
            f"p{i}": {
                "type": "string",
                "pattern": f"^(a|b){{{i % 7 + 3}}}[0-9]{{2,{i % 5 + 3}}}x{i}$",
            }
            for i in range(n)
        },
        "required": [f"p{i}" for i in range(0, n, 2)],
    }


def test_the_compile_time_is_bounded() -> None:
    cache = engine_cache(max_compile_ms=1)
    cache.tokenizer()  # built once per process, outside any compile's budget
    fmt = schema_format(_heavy_schema(300))
    started = time.perf_counter()
    with pytest.raises(GrammarError) as refused:
        cache.compile(fmt)
    assert refused.value.code == "timeout"
    assert "--max-grammar-compile-ms" in refused.value.reason
    assert time.perf_counter() - started < 5
    started = time.perf_counter()
    with pytest.raises(GrammarError):
        cache.compile(fmt)
    assert time.perf_counter() - started < 0.05  # refused again at once


def test_one_compile_per_format_and_a_bounded_cache() -> None:
    seen: list[tuple[str, bool]] = []

    class Observer:
        def looked_up(self, kind: str, hit: bool) -> None:
            seen.append((kind, hit))

        def compiled(self, kind: str, seconds: float, refusal: GrammarError | None) -> None:
            seen.append((kind, refusal is None))

    cache = engine_cache(max_entries=3, compile_threads=2, observer=Observer())
    fmt = schema_format(PERSON)
    futures = [cache.submit(fmt) for _ in range(8)]
    assert len({id(f.result()) for f in futures}) == 1
    assert cache.stats.misses == 1 and cache.stats.hits == 7
    assert seen.count(("json_schema", False)) == 1  # one miss, then one compile
    assert seen.count(("json_schema", True)) == 8  # seven hits, and the compile succeeded
    assert cache.compile(fmt) is futures[0].result()
    for i in range(5):
        cache.compile(ResponseFormat("regex", f"[a-z]{{{i + 1}}}"))
    assert len(cache) == 3
    assert grammar.format_key(fmt) == grammar.format_key(schema_format(PERSON))
    assert grammar.format_key(fmt) != grammar.format_key(ResponseFormat("grammar", fmt.text))


def test_compiles_run_off_the_calling_thread() -> None:
    cache = engine_cache()
    names: list[str] = []
    build = cache._build

    def spy(*args):
        names.append(threading.current_thread().name)
        return build(*args)

    cache._build = spy  # type: ignore[method-assign]
    cache.compile(ResponseFormat("regex", "abc"))
    assert names and names[0].startswith("grammar-compile")


def _advanced(cache, tok) -> list[grammar.Matcher]:
    formats = [
        schema_format(PERSON),
        ResponseFormat("regex", r"[a-z]+@[a-z]+\.com"),
        ResponseFormat("choice", options=("alpha", "beta")),
        ResponseFormat("json_object"),
    ]
    prefixes = ['{"name": "Al', "bob@ex", "al", '{"k": [1, ']
    matchers = []
    for fmt, prefix in zip(formats, prefixes):
        m = cache.compile(fmt).matcher()
        assert m.accept(tok.encode(prefix))
        matchers.append(m)
    return matchers


def test_batch_masks_equal_one_row_masks_and_leave_other_rows(cache, tok) -> None:
    matchers = _advanced(cache, tok)
    rows = [0, 2, 3, 5]
    batch = allocate_bitmask(6, VOCAB)
    grammar.fill_masks(matchers, rows, batch)
    for m, r in zip(matchers, rows):
        one = allocate_bitmask(1, VOCAB)
        m.fill_mask(one[0])
        assert np.array_equal(one[0], batch[r])
    assert (batch[[1, 4]] == -1).all()
    # The engine's own reference: unconstrained rows keep their logits bit for bit.
    logits = np.random.default_rng(0).standard_normal((6, VOCAB)).astype(np.float32)
    masked = logits.copy()
    apply_token_bitmask_inplace(masked, batch)
    assert np.array_equal(masked[[1, 4]], logits[[1, 4]])
    assert np.isfinite(masked[3]).sum() < 10  # the choice row: "alpha" after "al"


def test_rows_copy_several_lexers_that_mask_alike(tok) -> None:
    """The core's cache builds more originals of a format asked for again, each with a lexer
    of its own, and rows copy them in turn; every copy steps and masks as the first does."""
    cache = engine_cache(lexers=3)
    fmt = schema_format(PERSON)
    compiled = cache.compile(fmt)
    once = cache.compile(schema_format({**PERSON, "title": "asked for once"}))
    assert cache.compile(fmt) is compiled  # asked for again: its other originals follow
    deadline = time.monotonic() + 30
    while compiled.lexers < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiled.lexers == 3
    assert len({id(p) for p in compiled._protos}) == 3
    cache._lexer_pool.shutdown(wait=True)  # nothing was queued for the other format
    assert once.lexers == 1
    ids = tok.encode('{"name": "Ada", "age": 36, "tags": ["x", "long tag"]}')
    rows = [compiled.matcher() for _ in range(6)]  # two copies of each original
    batch = allocate_bitmask(len(rows), VOCAB)
    for t in ids:
        grammar.fill_masks(rows, range(len(rows)), batch)
        assert (batch == batch[0]).all() and allowed(batch[0], t)
        assert all(grammar.consume_many(rows, [t] * len(rows)))
    assert all(m.is_accepting() for m in rows)
    cache.close()
    # Asked for again while it compiles (the engine's tokenizer alone takes this fresh cache
    # far longer than the two calls): the other originals follow the compile.
    burst = engine_cache(lexers=2)
    first, second = burst.submit(fmt), burst.submit(fmt)
    compiled = first.result()
    assert second.result() is compiled
    deadline = time.monotonic() + 30
    while compiled.lexers < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiled.lexers == 2
    burst.close()


def test_draft_masks_equal_stepping(cache, tok) -> None:
    ids = tok.encode(dump({"name": "Cy", "age": 5}))
    m = cache.compile(schema_format(PERSON)).matcher()
    assert m.accept(ids[:3])
    draft = ids[3:7]
    assert m.validate(draft) == len(draft)
    out = allocate_bitmask(len(draft) + 1, VOCAB)
    grammar.fill_masks_with_drafts([m], [0], [draft], out)
    assert m.tokens == ids[:3]  # unchanged
    step = m.copy()
    for k in range(len(draft) + 1):
        one = allocate_bitmask(1, VOCAB)
        step.fill_mask(one[0])
        assert np.array_equal(one[0], out[k]), k
        if k < len(draft):
            assert step.accept(draft[k])


def test_a_padded_vocabulary_is_never_allowed(tok) -> None:
    text = tok.tokenizer_json()
    assert text is not None
    cache = GrammarCache(lambda: grammar.make_tokenizer(text, [EOS], VOCAB + 64))
    m = cache.compile(ResponseFormat("json_object")).matcher()
    row = allocate_bitmask(1, VOCAB + 64)
    m.fill_mask(row[0])
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[0 : VOCAB + 64]
    assert bits[:VOCAB].any() and not bits[VOCAB:].any()
