"""Structured output through the real server (embedded SmolLM2, CPU) and its generated stubs.

- Real schemas, one per JSONSchemaBench category (the vendored sample): every reply that
  finishes STOP parses and validates with `jsonschema`; a reply cut by max_tokens (LENGTH) is a
  prefix the same grammar accepts; refusals (schemas using what the engine does not enforce)
  are INVALID_ARGUMENT naming `response_format.json_schema`. The counts are printed apart.
- regex replies match in full, choice replies are one of the options, grammar and json_object
  replies parse, all in one batch beside free rows that get exactly what they get alone.
- Streaming, stop strings, max_tokens, logprobs, cancellation and the prefix cache with a
  format set; malformed and unsupported formats refused before they run, never INTERNAL.
- On a second server (one slot, preemption, prompt-lookup speculation, a 300 ms compile
  budget): a preempted constrained request resumes and ends as it does uninterrupted, drafts
  are verified under the grammar, and a format slower to compile than the budget is refused.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import pytest

from client import error_details
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.common.grammar import GrammarCache
from service.protocol import ResponseFormat
from tests.helpers.grammar import corpus, engine_cache, schema_format
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import ServerProcess, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.model]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
SUM_GRAMMAR = 'start: "sum(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'


def person_request(max_tokens: int = 48, **fields: Any) -> pb.GenerateRequest:
    return chat_request(
        "Describe a person.",
        max_tokens=max_tokens,
        response_format=fmt(json_schema=PERSON),
        **fields,
    )


def fmt(**kind: Any) -> pb.ResponseFormat:
    if "json_schema" in kind and not isinstance(kind["json_schema"], str):
        kind["json_schema"] = json.dumps(kind["json_schema"])
    if "choice" in kind:
        kind["choice"] = pb.ChoiceList(options=kind["choice"])
    return pb.ResponseFormat(**kind)


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    """The same engine and options on the test's side: what the server's replies must satisfy."""
    return engine_cache(max_entries=128)


def accepted_prefix(grammars: GrammarCache, schema: Any, token_ids: list[int]) -> bool:
    m = grammars.compile(schema_format(schema)).matcher()
    return m.accept(token_ids)


def validate(schema: Any, text: str) -> None:
    instance = json.loads(text)
    validator = jsonschema.validators.validator_for(schema)
    validator(schema).validate(instance)


# -- real schemas --------------------------------------------------------------------------------

# Each reply's budget: enough for the small documents to complete (STOP, validated whole); the
# others are cut (LENGTH, checked as prefixes), which a longer budget would only lengthen.
BENCH_TOKENS = 40


def test_a_real_schema_from_each_jsonschemabench_category(stub, grammars) -> None:
    cases: dict[str, dict] = {}
    for case in sorted(corpus("jsonschemabench.json"), key=lambda c: c["id"]):
        cases.setdefault(case["category"], case)
    futures = {}
    for category, case in cases.items():
        request = chat_request(
            "Reply with one example JSON document.",
            max_tokens=BENCH_TOKENS,
            response_format=fmt(json_schema=case["schema"]),
            cache_prompt=False,
        )
        futures[category] = stub.Generate.future(request, timeout=600)
    outcome: dict[str, list[str]] = {"stop": [], "length": [], "refused": []}
    problems = []
    for category, future in futures.items():
        schema = cases[category]["schema"]
        try:
            reply = future.result()
        except grpc.RpcError as err:
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (category, err.details())
            violation = error_details(err).field_violations[0]
            assert violation.field == "response_format.json_schema"
            assert violation.description == err.details() and err.details()
            outcome["refused"].append(category)
            continue
        if reply.finish_reason == pb.FINISH_REASON_STOP:
            outcome["stop"].append(category)
            try:
                validate(schema, reply.text)
            except (ValueError, jsonschema.ValidationError) as exc:
                problems.append(f"{category}: {reply.text!r}: {exc}")
        else:
            assert reply.finish_reason == pb.FINISH_REASON_LENGTH, category
            assert reply.usage.completion_tokens == BENCH_TOKENS
            outcome["length"].append(category)
            if not accepted_prefix(grammars, schema, list(reply.token_ids)):
                problems.append(f"{category}: a LENGTH reply the grammar refuses: {reply.text!r}")
    print(
        f"\nJSONSchemaBench through the server, {len(cases)} categories: "
        + "; ".join(f"{k} {len(v)} ({', '.join(sorted(v))})" for k, v in outcome.items())
    )
    assert problems == []  # every STOP reply validates: 100 %
    assert len(outcome["stop"]) >= 5
    assert {"Handwritten", "Synthesized"} <= set(outcome["refused"])  # they exercise `not`


# -- every kind, inside one batch ----------------------------------------------------------------


def test_every_kind_inside_one_batch_beside_free_rows(stub, reference, grammars) -> None:
    free = [
        chat_request("Name three fruits.", max_tokens=16),
        chat_request("What is the capital of France?", max_tokens=16),
    ]
    kinds = {
        "json_schema": person_request(),
        "json_object": chat_request(
            "Give me a JSON object about a cat.",
            max_tokens=48,
            response_format=fmt(json_object=True),
        ),
        "regex": chat_request(
            "What is your phone number?", max_tokens=24, response_format=fmt(regex=PHONE)
        ),
        "grammar": chat_request(
            "Add some numbers.", max_tokens=24, response_format=fmt(grammar=SUM_GRAMMAR)
        ),
        "choice": chat_request(
            "I love this movie! Sentiment?", max_tokens=8, response_format=fmt(choice=CHOICES)
        ),
    }
    alone = [reference(r) for r in free]
    futures = [stub.Generate.future(r, timeout=300) for r in [*free, *kinds.values()]]
    replies = [f.result() for f in futures]
    for got, want in zip(replies[:2], alone):
        assert list(got.token_ids) == list(want.token_ids)  # free rows pay nothing
    out = dict(zip(kinds, replies[2:]))
    obj = out.pop("json_object")  # any object: it may nest past max_tokens
    if obj.finish_reason == pb.FINISH_REASON_STOP:
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == pb.FINISH_REASON_LENGTH
        m = grammars.compile(ResponseFormat("json_object")).matcher()
        assert obj.text.startswith("{") and m.accept(list(obj.token_ids))
    for kind, reply in out.items():
        assert reply.finish_reason == pb.FINISH_REASON_STOP, (kind, reply.text)
    validate(PERSON, out["json_schema"].text)
    assert re.fullmatch(PHONE, out["regex"].text)
    assert re.fullmatch(r"sum\([0-9]{1,3}(,[0-9]{1,3})*\)", out["grammar"].text)
    assert out["choice"].text in CHOICES
    # The format is deterministic too: alone it gives the same reply.
    assert list(reference(kinds["json_schema"]).token_ids) == list(out["json_schema"].token_ids)


def test_streamed_chunks_extend_the_document(stub, reference) -> None:
    request = person_request()
    text, chunks = "", 0
    for message in stub.StreamGenerate(to_stream(request), timeout=300):
        text += message.text
        chunks += 1
        if message.finish_reason:
            assert message.finish_reason == pb.FINISH_REASON_STOP
    assert chunks > 3
    validate(PERSON, text)
    assert text == reference(request).text  # the same request unary (run once per session)


def test_stop_strings_and_max_tokens_end_a_document_early(stub, grammars) -> None:
    stopped = stub.Generate(person_request(stopping=pb.StoppingCriteria(stop=[", "])), timeout=300)
    assert stopped.finish_reason == pb.FINISH_REASON_STOP and stopped.stop_string == ", "
    assert ", " not in stopped.text and stopped.text.startswith('{"name": ')
    cut = stub.Generate(person_request(max_tokens=5), timeout=300)
    assert cut.finish_reason == pb.FINISH_REASON_LENGTH  # says the document is incomplete
    assert len(cut.token_ids) == 5
    assert accepted_prefix(grammars, PERSON, list(cut.token_ids))


def test_logprob_alternatives_are_only_tokens_the_format_allows(stub, grammars) -> None:
    reply = stub.Generate(
        chat_request(
            "Sentiment of: what a lovely day.",
            max_tokens=8,
            response_format=fmt(choice=CHOICES),
            logprobs=True,
            top_logprobs=5,
        ),
        timeout=300,
    )
    assert reply.text in CHOICES
    compiled = grammars.compile(ResponseFormat("choice", options=tuple(CHOICES)))
    m = compiled.matcher()
    for entry in reply.logprobs:
        assert entry.logprob > float("-inf")
        for alt in entry.top_logprobs:
            assert alt.logprob > float("-inf")
            assert m.validate([alt.token_id]) == 1, alt.token
        if entry.token_id in (2,):  # EOS ends it
            break
        assert m.accept(entry.token_id)


def test_cancellation_and_the_prefix_cache_with_a_format(stub) -> None:
    stream = stub.StreamGenerate(
        to_stream(
            chat_request(
                "Write a long JSON object.", max_tokens=400, response_format=fmt(json_object=True)
            )
        ),
        timeout=300,
    )
    next(stream)
    next(stream)
    stream.cancel()
    wait_idle(stub)
    long_prompt = "You are a records clerk. " * 12 + "Describe a person."
    request = chat_request(long_prompt, max_tokens=48, response_format=fmt(json_schema=PERSON))
    first = stub.Generate(request, timeout=300)
    again = stub.Generate(request, timeout=300)
    assert again.usage.cached_tokens > 0
    assert again.text == first.text
    validate(PERSON, again.text)


@pytest.mark.parametrize(
    ("response_format", "field", "words"),
    [
        (fmt(json_schema="{not json"), "response_format.json_schema", "not valid JSON"),
        (
            fmt(json_schema='{"type": "array", "uniqueItems": true}'),
            "response_format.json_schema",
            "uniqueItems",
        ),
        (fmt(json_schema='{"type": "strng"}'), "response_format.json_schema", "strng"),
        (fmt(json_schema=" "), "response_format.json_schema", "empty"),
        (fmt(json_object=False), "response_format.json_object", "must be true"),
        (fmt(regex="a(b"), "response_format.regex", "unclosed group"),
        (fmt(regex="(?=a)b"), "response_format.regex", "look"),
        (fmt(grammar="start: missing_rule"), "response_format.grammar", "missing_rule"),
        (fmt(choice=[]), "response_format.choice.options", "at least one"),
        (fmt(choice=["a", ""]), "response_format.choice.options[1]", "empty"),
    ],
)
def test_bad_formats_are_refused_before_they_run(stub, response_format, field, words) -> None:
    request = chat_request("Hi", max_tokens=4, response_format=response_format)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=60)
    err = refused.value
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    details = error_details(err)
    assert details.field_violations[0].field == field
    assert details.reason == "INVALID_REQUEST"
    assert words.lower() in err.details().lower(), err.details()
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.StreamGenerate(to_stream(request), timeout=60))
    assert streamed.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_names_the_engine(stub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).structured_output
    assert info.engine == "llguidance" and info.engine_version == "1.9.1"
    assert list(info.kinds) == ["json_schema", "json_object", "regex", "grammar", "choice"]
    assert info.grammar_syntax == "llguidance Lark" and info.max_compile_ms == 2000


# -- preemption, speculation, the compile budget ---------------------------------------------------


@pytest.fixture(scope="module")
def one_slot(
    one_slot_server: ServerProcess,
) -> Iterator[tuple[ServerProcess, pb_grpc.GenerationServiceStub]]:
    """The session's one-row server (conftest.one_slot_server) and a stub to it."""
    with grpc.insecure_channel(one_slot_server.target) as channel:
        yield one_slot_server, pb_grpc.GenerationServiceStub(channel)


def test_a_preempted_request_resumes_its_document(one_slot) -> None:
    _, stub = one_slot
    request = person_request(priority=0, cache_prompt=False)
    alone = stub.Generate(request, timeout=300)
    validate(PERSON, alone.text)
    before = stub.CacheStats(pb.CacheStatsRequest(), timeout=10).preemptions
    low = stub.StreamGenerate(to_stream(request), timeout=300)
    messages = [next(low), next(low)]  # it runs
    urgent = chat_request("Say hi.", max_tokens=4, priority=5)
    assert stub.Generate(urgent, timeout=300).finish_reason
    messages += list(low)
    assert stub.CacheStats(pb.CacheStatsRequest(), timeout=10).preemptions == before + 1
    assert "".join(m.text for m in messages) == alone.text
    assert messages[-1].finish_reason == pb.FINISH_REASON_STOP


def test_drafts_are_verified_under_the_grammar(one_slot) -> None:
    _, stub = one_slot
    doc = json.dumps({"name": "Ada Lovelace", "age": 36, "city": "London"})
    reply = stub.Generate(
        chat_request(
            f"Repeat this JSON exactly: {doc}",
            max_tokens=48,
            response_format=fmt(json_schema=PERSON),
        ),
        timeout=300,
    )
    assert reply.finish_reason == pb.FINISH_REASON_STOP
    validate(PERSON, reply.text)
    assert reply.usage.drafted_tokens > 0 and reply.usage.accepted_tokens > 0


def test_a_format_slower_to_compile_than_the_budget_is_refused(one_slot) -> None:
    server, stub = one_slot
    assert (
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).structured_output.max_compile_ms
        == 300
    )
    rng = random.Random(7)
    options = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=16)) for _ in range(30000)]
    request = chat_request("Pick one.", max_tokens=4, response_format=fmt(choice=options))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=120)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-grammar-compile-ms" in refused.value.details()
    assert (
        error_details(refused.value).field_violations[0].field == "response_format.choice.options"
    )
    record = server.wait_for_record(lambda r: r.get("field") == "response_format.choice.options")
    assert record["event"] == "request rejected"
