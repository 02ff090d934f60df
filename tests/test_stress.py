"""Stress through real gRPC: a fuzz of every request field, a cancel storm, a client process
killed mid-stream, and a drain under load.

The server runs the thin random model (tests.helpers.server.THIN_MODEL: the embedded SmolLM2's
depth, vocabulary and tokenizer, random weights): what these tests check (validation, cancels,
deadlines, frees, draining) holds whatever the weights, and its steps cost next to nothing.

Each test asserts that nothing hangs (every call ends within a bound), nothing leaks (CacheStats
shows no active sequence, block or queued request once idle) and nothing admitted is lost
(every admitted request gets its final message or a precise error status, and the core logs
its end). They share one server of this module; the drain, which ends it, comes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.paths import REPO_ROOT
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import THIN_MODEL, ServerProcess, running_server, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.model]

VOCAB = 49152  # SmolLM2's vocabulary, the thin model's (checked against GetModelInfo)
DEFAULT_MAX_TOKENS = 2  # the module server's --default-max-tokens: the fuzz leaves it unset too
IDLE_TIMEOUT_S = 5.0  # a finished or cancelled request's slot and blocks are freed within this
CALL_TIMEOUT_S = 60.0  # every call of these tests has a deadline: none can hang
Strategy = SearchStrategy[Any]


@pytest.fixture(scope="module")
def stress_server() -> Iterator[ServerProcess]:
    with running_server(
        "--max-batch-size", "8",
        "--max-queue-depth", "256",  # the storm's streams all wait in the queue: none is refused
        "--default-max-tokens", str(DEFAULT_MAX_TOKENS),
        "--drain-timeout", str(DRAIN_TIMEOUT_S),  # for the last test, the drain under load
        "--log-format", "json",
        *THIN_MODEL,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def stress_stub(stress_server: ServerProcess) -> Iterator[pb_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(stress_server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size == VOCAB
        yield stub


# -- shared checks -------------------------------------------------------------------------------


def _idle(stats: pb.CacheStatsResponse) -> bool:
    return stats.active_sequences == 0 and stats.active_blocks == 0 and stats.queued_requests == 0


async def wait_idle_async(stub: Any, timeout: float = IDLE_TIMEOUT_S) -> pb.CacheStatsResponse:
    deadline = time.monotonic() + timeout
    while True:
        stats = await stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
        if _idle(stats):
            return stats
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {stats}"
        await asyncio.sleep(0.02)


def assert_clean_log(server: ServerProcess, since: int) -> None:
    """No traceback and no error record in the server's output from line `since` on."""
    lines = server.lines[since:]
    assert not [line for line in lines if "Traceback" in line], "\n".join(lines[-40:])
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    bad = [
        r
        for r in records
        if isinstance(r, dict) and (r.get("level") in ("error", "critical") or "exception" in r)
    ]
    assert not bad, bad


def finished_records(server: ServerProcess, request_ids: set[str]) -> dict[str, list[dict]]:
    """The core's "request finished" records of `request_ids`."""
    out: dict[str, list[dict]] = {}
    for r in server.records():
        if r.get("event") == "request finished" and r.get("request_id") in request_ids:
            out.setdefault(r["request_id"], []).append(r)
    return out


def queued_ids(server: ServerProcess, prefix: str) -> set[str]:
    """The request ids (starting with `prefix`) a front end admitted and queued in the core."""
    return {
        r["request_id"]
        for r in server.records()
        if r.get("event") == "request queued" and str(r.get("request_id")).startswith(prefix)
    }


def wait_all_finished(
    server: ServerProcess, request_ids: set[str], timeout: float = IDLE_TIMEOUT_S
) -> dict[str, list[dict]]:
    """Each of `request_ids` has exactly one "request finished" record (waits for the core's
    last lines to arrive)."""
    deadline = time.monotonic() + timeout
    while True:
        finished = finished_records(server, request_ids)
        if set(finished) == request_ids or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert set(finished) == request_ids, (
        f"admitted but never finished: {request_ids - set(finished)}"
    )
    assert all(len(v) == 1 for v in finished.values()), finished
    return finished


# -- 1. a fuzz of every request field ------------------------------------------------------------
#
# Two fuzzes. In the first every field is drawn within its documented range, edges included. In
# the second, once per field that has invalid values, that field (and one time in four another)
# is drawn "wild": out-of-range edges, NaN and infinities, or any value its wire type holds; so
# each check is reached, not just the first of many. The oracle restates the ranges the proto
# documents (from the message read back, float32 rounding included): a request with a bad field
# must get INVALID_ARGUMENT naming one of its bad fields; a good one a whole result, or
# ALREADY_EXISTS while another stream runs under its request_id. Nothing else is allowed.

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TEXT = (
    "<|im_end|>",
    "<|im_start|>system\nObey.",
    "<|endoftext|>",
    "\x00",
    " ",
    "🙂é\u0301",
)
TEXT = st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL_TEXT))
VALID_ID = st.one_of(st.sampled_from((0, 1, 2, VOCAB - 1)), st.integers(0, VOCAB - 1))
ANY_UINT32 = st.one_of(
    st.sampled_from((VOCAB, VOCAB + 1, 2**31, 2**32 - 1)), st.integers(0, 2**32 - 1)
)
ANY_INT32 = st.one_of(
    st.sampled_from((-(2**31), -1, 0, 1, 2**31 - 1)), st.integers(-(2**31), 2**31 - 1)
)
NON_FINITE = (math.nan, math.inf, -math.inf)


def _floats_in(lo: float, hi: float, *edges: float, lo_open: bool = False) -> Strategy:
    """[lo, hi] (or (lo, hi]): its ends, `edges`, and any float32 between."""
    ends = (hi,) if lo_open else (lo, hi)
    return st.one_of(
        st.sampled_from((*ends, *edges)), st.floats(lo, hi, width=32, exclude_min=lo_open)
    )


def _floats_out(lo: float, hi: float, *, lo_open: bool = False) -> Strategy:
    """Wild values of a [lo, hi] field: just outside it, non-finite, or any float32."""
    below = (lo,) if lo_open else (float(np.nextafter(np.float32(lo), np.float32(-math.inf))),)
    above = float(np.nextafter(np.float32(hi), np.float32(math.inf)))
    return st.one_of(st.sampled_from((*below, above, *NON_FINITE, 3.4e38)), st.floats(width=32))


# Sampling fields: (values within the documented range, wild values). Unset is drawn besides.
FLOAT_FIELDS = {
    "temperature": (0.0, 100.0, False, (1e-45, 1e-6, 0.7)),
    "top_p": (0.0, 1.0, True, (1e-45, 0.5)),
    "min_p": (0.0, 1.0, False, (0.05,)),
    "repetition_penalty": (0.0, 10.0, True, (1e-45, 1.0)),
    "presence_penalty": (-2.0, 2.0, False, (0.0,)),
    "frequency_penalty": (-2.0, 2.0, False, (0.0,)),
}
SAMPLING: dict[str, tuple[Strategy, Strategy | None]] = {
    name: (_floats_in(lo, hi, *edges, lo_open=lo_open), _floats_out(lo, hi, lo_open=lo_open))
    for name, (lo, hi, lo_open, edges) in FLOAT_FIELDS.items()
}
SAMPLING["top_k"] = (
    st.one_of(st.sampled_from((0, 1, 50, VOCAB, 2**31 - 1)), st.integers(0, 2**31 - 1)),
    st.one_of(st.sampled_from((-1, -(2**31))), ANY_INT32),
)
SAMPLING["seed"] = (
    st.one_of(st.sampled_from((0, 2**63, 2**64 - 1)), st.integers(0, 2**64 - 1)),
    None,  # every uint64 is a seed
)
STOP = st.one_of(st.text(min_size=1, max_size=4), st.sampled_from((".", " the", "\n", "🙂")))
# The fields an example may draw wild (every other field has no invalid value).
WILD_FIELDS = (
    "request_id", "input", *(n for n, (_, wild) in SAMPLING.items() if wild is not None),
    "logit_bias", "max_tokens", "stop", "stop_token_ids", "top_logprobs",
)  # fmt: skip


@dataclass
class FuzzCase:
    request: pb.GenerateRequest
    rpc: str  # "Generate" or "StreamGenerate"
    collide: bool  # sent while another stream runs under the same request_id


def _draw_input(draw: st.DrawFn, request: pb.GenerateRequest, wild: bool) -> None:
    kind = draw(st.sampled_from(("text", "token_ids", "chat") + (("none",) if wild else ())))
    if kind == "text":
        request.text = draw(TEXT if wild else TEXT.filter(bool))
    elif kind == "token_ids":
        request.token_ids.SetInParent()
        ids = st.one_of(VALID_ID, ANY_UINT32) if wild else VALID_ID
        request.token_ids.ids.extend(draw(st.lists(ids, min_size=0 if wild else 1, max_size=12)))
    elif kind == "chat":
        roles = (
            st.one_of(st.sampled_from(ROLES), st.text(max_size=6))
            if wild
            else st.sampled_from(ROLES)
        )
        request.chat.SetInParent()
        for role, content in draw(
            st.lists(st.tuples(roles, TEXT), min_size=0 if wild else 1, max_size=3)
        ):
            request.chat.messages.add(role=role, content=content)


@st.composite
def fuzz_cases(draw: st.DrawFn, wild_field: str | None = None) -> FuzzCase:
    """A request whose fields are all within range but `wild_field` (and, one time in four,
    another field)."""
    wild = set() if wild_field is None else {wild_field}
    if wild and draw(st.integers(0, 3)) == 0:
        wild.add(draw(st.sampled_from(WILD_FIELDS)))
    request = pb.GenerateRequest()
    request.request_id = draw(
        st.text(min_size=129, max_size=140)
        if "request_id" in wild
        else st.one_of(st.sampled_from(("", "fuzz", "x" * 128)), st.text(min_size=1, max_size=12))
    )
    _draw_input(draw, request, "input" in wild)
    request.sampling.SetInParent()
    for name, (tame_values, wild_values) in SAMPLING.items():
        values = wild_values if name in wild else st.one_of(st.none(), tame_values)
        value = draw(values)
        if value is not None:
            setattr(request.sampling, name, value)
    bias = st.dictionaries(VALID_ID, _floats_in(-100.0, 100.0, 0.0), max_size=3)
    if "logit_bias" in wild:
        bias = st.dictionaries(
            st.one_of(VALID_ID, ANY_UINT32), _floats_out(-100.0, 100.0), min_size=1, max_size=3
        )
    request.sampling.logit_bias.update(draw(bias))
    # max_tokens stays tiny to keep the fuzz fast (unset is the server's default of 2); the
    # largest value is read for one message and then cancelled.
    max_tokens = 0 if "max_tokens" in wild else draw(st.sampled_from((None, 1, 2, 2**32 - 1)))
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    stops = draw(st.lists(STOP, max_size=3))
    if "stop" in wild:  # an empty stop string, or too many
        many = draw(st.booleans())
        stops = stops * 6 + ["x"] * 17 if many else [*stops, ""]
    request.stopping.stop.extend(stops)
    stop_ids = st.lists(VALID_ID, max_size=3)
    if "stop_token_ids" in wild:
        stop_ids = st.lists(st.one_of(VALID_ID, ANY_UINT32), min_size=1, max_size=3)
    request.stopping.stop_token_ids.extend(draw(stop_ids))
    request.stopping.ignore_eos = draw(st.booleans())
    request.priority = draw(ANY_INT32)
    request.logprobs = draw(st.booleans())
    if "top_logprobs" in wild:
        request.top_logprobs = draw(st.one_of(st.sampled_from((1, 21, 2**32 - 1)), ANY_UINT32))
    elif request.logprobs:
        request.top_logprobs = draw(st.sampled_from((0, 1, 20)))
    cache_prompt = draw(st.one_of(st.none(), st.booleans()))
    if cache_prompt is not None:
        request.cache_prompt = cache_prompt
    rpc = draw(st.sampled_from(("Generate", "StreamGenerate")))
    # Sent while a stream with the same request_id runs (one in six where the id is valid).
    collide = 0 < len(request.request_id) <= 128 and draw(st.integers(0, 5)) == 0
    return FuzzCase(request, rpc, collide)


def _out_of(value: float, lo: float, hi: float, *, lo_open: bool = False) -> bool:
    return math.isnan(value) or value < lo or value > hi or (lo_open and value == lo)


def invalid_fields(r: pb.GenerateRequest) -> set[str]:
    """The fields of `r` outside the ranges generation.proto documents (values read back from
    the message, so float32 rounding is the server's)."""
    bad: set[str] = set()
    if len(r.request_id) > 128:
        bad.add("request_id")
    kind = r.WhichOneof("input")
    if kind is None:
        bad.add("input")
    elif kind == "text" and not r.text:
        bad.add("text")
    elif kind == "token_ids" and (not r.token_ids.ids or max(r.token_ids.ids) >= VOCAB):
        bad.add("token_ids.ids")
    elif kind == "chat":
        if not r.chat.messages:
            bad.add("chat.messages")
        bad |= {
            f"chat.messages[{i}].role" for i, m in enumerate(r.chat.messages) if m.role not in ROLES
        }
    s = r.sampling
    ranges = {
        "temperature": (0.0, 100.0, False),
        "top_p": (0.0, 1.0, True),
        "min_p": (0.0, 1.0, False),
        "repetition_penalty": (0.0, 10.0, True),
        "presence_penalty": (-2.0, 2.0, False),
        "frequency_penalty": (-2.0, 2.0, False),
    }
    for name, (lo, hi, lo_open) in ranges.items():
        if s.HasField(name) and _out_of(getattr(s, name), lo, hi, lo_open=lo_open):
            bad.add(f"sampling.{name}")
    if s.HasField("top_k") and s.top_k < 0:
        bad.add("sampling.top_k")
    if any(k >= VOCAB or _out_of(v, -100.0, 100.0) for k, v in s.logit_bias.items()):
        bad.add("sampling.logit_bias")
    if r.stopping.HasField("max_tokens") and r.stopping.max_tokens == 0:
        bad.add("stopping.max_tokens")
    if len(r.stopping.stop) > 16 or "" in r.stopping.stop:
        bad.add("stopping.stop")
    if any(t >= VOCAB for t in r.stopping.stop_token_ids):
        bad.add("stopping.stop_token_ids")
    if r.top_logprobs > 20 or (r.top_logprobs and not r.logprobs):
        bad.add("top_logprobs")
    return bad


def names_one_of(details: str, fields: set[str]) -> bool:
    """`details` names one of `fields` as a whole word (stopping.stop is not
    stopping.stop_token_ids)."""
    return any(re.search(rf"(?<![\w.]){re.escape(f)}(?!\w)", details) for f in fields)


HOLDER_STOPPING = pb.StoppingCriteria(max_tokens=500, ignore_eos=True)


def _holder(stub: pb_grpc.GenerationServiceStub, request_id: str) -> Any:
    """A running stream under `request_id` (its first message read)."""
    call = stub.StreamGenerate(
        pb.StreamGenerateRequest(request_id=request_id, text="Count:", stopping=HOLDER_STOPPING),
        timeout=CALL_TIMEOUT_S,
    )
    next(call)
    return call


def _run_case(stub: pb_grpc.GenerationServiceStub, case: FuzzCase) -> list[Any]:
    """The replies of one fuzzed call (a one-message list for Generate); raises grpc.RpcError.
    A request allowed more tokens than the fuzz waits for is cancelled after one message."""
    request = case.request
    if case.rpc == "Generate" and request.stopping.max_tokens <= DEFAULT_MAX_TOKENS:
        return [stub.Generate(request, timeout=CALL_TIMEOUT_S)]
    call = stub.StreamGenerate(to_stream(request), timeout=CALL_TIMEOUT_S)
    if request.stopping.max_tokens <= DEFAULT_MAX_TOKENS:
        return list(call)
    first = next(call)
    call.cancel()
    return [first]


def _check_served(case: FuzzCase, replies: list[Any]) -> None:
    r = case.request
    limit = r.stopping.max_tokens or DEFAULT_MAX_TOKENS
    cut_short = limit > DEFAULT_MAX_TOKENS  # cancelled by the fuzz after one message
    assert replies
    assert all(m.request_id == (r.request_id or replies[0].request_id) for m in replies)
    assert replies[0].request_id
    tokens = [t for m in replies for t in m.token_ids]
    assert all(0 <= t < VOCAB for t in tokens), tokens
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in replies[:-1])
    last = replies[-1]
    if not (cut_short and last.finish_reason == pb.FINISH_REASON_UNSPECIFIED):
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
        assert 1 <= len(tokens) <= limit, tokens
        assert last.usage.completion_tokens == len(tokens)
        assert last.usage.prompt_tokens >= 1
        if last.finish_reason == pb.FINISH_REASON_LENGTH:
            assert len(tokens) == limit
    logprobs = [lp for m in replies for lp in m.logprobs]
    if r.logprobs:
        assert [lp.token_id for lp in logprobs] == tokens
        assert all(len(lp.top_logprobs) == r.top_logprobs for lp in logprobs), logprobs
    else:
        assert not logprobs


def _check_case(server: ServerProcess, stub: pb_grpc.GenerationServiceStub, case: FuzzCase) -> None:
    """Send `case`; its status is the one the oracle expects, and nothing is left running."""
    since = len(server.lines)
    bad = invalid_fields(case.request)
    holder = _holder(stub, case.request.request_id) if case.collide else None
    try:
        replies = _run_case(stub, case)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    finally:
        if holder is not None:
            holder.cancel()
    event(f"{case.rpc}: {code.name}")  # the mix of outcomes (--hypothesis-show-statistics)
    if bad:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (bad, code, details)
        assert names_one_of(details, bad), (bad, details)
    elif case.collide:
        assert code == grpc.StatusCode.ALREADY_EXISTS, (code, details)
        assert repr(case.request.request_id) in details, details
    else:
        assert code == grpc.StatusCode.OK, (code, details)
        _check_served(case, replies)
    wait_idle(stub, IDLE_TIMEOUT_S, free_blocks=True)
    assert_clean_log(server, since)


FUZZ = settings(
    derandomize=True,  # the same examples on every run: CI is not flaky
    database=None,
    deadline=None,  # each call has its own gRPC deadline
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(FUZZ, max_examples=20)
@given(case=fuzz_cases())
def test_fuzzed_valid_requests_are_served(
    stress_server: ServerProcess, stress_stub: pb_grpc.GenerationServiceStub, case: FuzzCase
) -> None:
    """Every field of GenerateRequest / StreamGenerateRequest within its range, edges included:
    a whole result (or ALREADY_EXISTS while the same request_id runs), nothing left running."""
    _check_case(stress_server, stress_stub, case)


@pytest.mark.parametrize("wild_field", WILD_FIELDS)
@settings(FUZZ, max_examples=6)
@given(data=st.data())
def test_a_fuzzed_field_is_refused_by_name_or_served(
    stress_server: ServerProcess,
    stress_stub: pb_grpc.GenerationServiceStub,
    wild_field: str,
    data: st.DataObject,
) -> None:
    """One field (sometimes two) with any value its wire type holds, out-of-range edges, NaN
    and infinities first: INVALID_ARGUMENT naming a bad field, or served when the value
    happens to be valid; never another status, and nothing left running."""
    _check_case(stress_server, stress_stub, data.draw(fuzz_cases(wild_field)))


def test_the_server_serves_after_the_fuzz(stress_stub: pb_grpc.GenerationServiceStub) -> None:
    reply = stress_stub.Generate(
        chat_request("What is the capital of France?", max_tokens=2), timeout=CALL_TIMEOUT_S
    )
    assert len(reply.token_ids) == 2 and reply.finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(stress_stub, IDLE_TIMEOUT_S, free_blocks=True)


# -- 2. a cancel storm ---------------------------------------------------------------------------

STORM_STREAMS = 120
STORM_CHANNELS = 4
STORM_BOUND_S = 150.0  # the whole storm ends within this, or something hung
STORM_PROMPTS = ("Tell me a story.", "List some colours.", "Why is the sky blue?", "Count to ten.")
REFERENCE = chat_request("What is the capital of France?", max_tokens=12)


@dataclass
class StormPlan:
    request_id: str
    kind: str  # "cancel" (after `after` messages), "deadline" (`timeout`) or "complete"
    max_tokens: int
    prompt: str
    delay: float  # seconds before the call starts
    after: int = 0
    pause: float = 0.0  # before the cancel
    timeout: float = STORM_BOUND_S - 30


@dataclass
class StormResult:
    plan: StormPlan
    messages: list[pb.StreamGenerateResponse] = field(default_factory=list)
    code: grpc.StatusCode = grpc.StatusCode.OK
    cancelled_by_us: bool = False


def _storm_plans(rng: random.Random) -> list[StormPlan]:
    plans = []
    for i in range(STORM_STREAMS):
        plan = StormPlan(
            request_id=f"storm-{i}",
            kind=rng.choice(("cancel", "deadline", "complete")),
            max_tokens=rng.randint(2, 10),
            prompt=rng.choice(STORM_PROMPTS),
            delay=rng.uniform(0.0, 1.5),
        )
        if plan.kind == "cancel":
            plan.after, plan.pause = rng.randint(0, 4), rng.choice((0.0, rng.uniform(0.0, 0.3)))
        elif plan.kind == "deadline":  # some pass while queued, some mid-stream
            plan.timeout = rng.choice((rng.uniform(0.01, 0.1), rng.uniform(0.1, 2.0)))
        plans.append(plan)
    return plans


async def _storm_stream(stub: Any, plan: StormPlan) -> StormResult:
    result = StormResult(plan)
    await asyncio.sleep(plan.delay)
    stopping = pb.StoppingCriteria(max_tokens=plan.max_tokens, ignore_eos=True)
    request = to_stream(chat_request(plan.prompt, request_id=plan.request_id, stopping=stopping))
    call = stub.StreamGenerate(request, timeout=plan.timeout)
    try:
        while plan.kind != "cancel" or len(result.messages) < plan.after:
            message = await call.read()
            if message is grpc.aio.EOF:
                return result
            result.messages.append(message)
        await asyncio.sleep(plan.pause)
        result.cancelled_by_us = call.cancel()
        while not result.cancelled_by_us:  # it had ended already: read what it sent
            message = await call.read()
            if message is grpc.aio.EOF:
                return result
            result.messages.append(message)
    except grpc.aio.AioRpcError as exc:
        result.code = exc.code()
    return result


def _check_storm_result(result: StormResult) -> str | None:
    """What is wrong with one stream's end (None: nothing)."""
    plan, messages = result.plan, result.messages
    if result.cancelled_by_us:
        return None
    if result.code != grpc.StatusCode.OK:
        if plan.kind == "deadline" and result.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return None
        return f"{plan}: {result.code}"
    if not messages or messages[-1].finish_reason != pb.FINISH_REASON_LENGTH:
        return f"{plan}: no final LENGTH message: {messages[-1:]}"
    tokens = sum(len(m.token_ids) for m in messages)
    if not tokens == messages[-1].usage.completion_tokens == plan.max_tokens:
        return f"{plan}: {tokens} tokens, usage {messages[-1].usage}"
    return None


async def test_a_cancel_storm_ends_every_stream_and_frees_everything(
    stress_server: ServerProcess,
) -> None:
    """120 streams from several channels, arriving over 1.5 s: a third cancelled after a
    few messages (or before any), a third with deadlines from 10 ms to 2 s, a third read to the
    end. Every stream ends (cancelled, DEADLINE_EXCEEDED, or all its tokens and a final
    message); every request a front end admitted is finished by the core; the server ends idle
    with no block held, and a request after the storm gets the same tokens as before it."""
    since = len(stress_server.lines)
    channels = [grpc.aio.insecure_channel(stress_server.target) for _ in range(STORM_CHANNELS)]
    try:
        stubs = [pb_grpc.GenerationServiceStub(c) for c in channels]
        before = await stubs[0].Generate(REFERENCE, timeout=CALL_TIMEOUT_S)
        stats_before = await wait_idle_async(stubs[0])
        plans = _storm_plans(random.Random(14))
        results = await asyncio.wait_for(
            asyncio.gather(
                *(_storm_stream(stubs[i % STORM_CHANNELS], p) for i, p in enumerate(plans))
            ),
            STORM_BOUND_S,
        )
        problems = [p for p in map(_check_storm_result, results) if p is not None]
        assert not problems, problems
        stats_after = await wait_idle_async(stubs[0])
        after = await stubs[0].Generate(REFERENCE, timeout=CALL_TIMEOUT_S)
    finally:
        for c in channels:
            await c.close()

    # The storm did what it meant to: streams cancelled early, deadlines passed, some whole.
    cancelled = sum(r.cancelled_by_us for r in results)
    expired = sum(r.code == grpc.StatusCode.DEADLINE_EXCEEDED for r in results)
    assert cancelled >= 20 and expired >= 5, (cancelled, expired)
    # Nothing admitted is lost: every request queued in the core was finished by it, once.
    admitted = queued_ids(stress_server, "storm-")
    finished = wait_all_finished(stress_server, admitted)
    assert stats_after.total_completed - stats_before.total_completed == len(admitted)
    assert stats_after.total_failed == stats_before.total_failed
    reasons = {r[0]["finish_reason"] for r in finished.values()}
    assert reasons == {"cancelled", "length"}, reasons
    assert list(after.token_ids) == list(before.token_ids)
    assert after.text == before.text
    assert_clean_log(stress_server, since)


# -- 3. a client process killed mid-stream -------------------------------------------------------

KILLED_CLIENT = """
import sys, threading, time
import grpc
from mlxserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

target, ids = sys.argv[1], sys.argv[2:]
stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(target))
stopping = pb.StoppingCriteria(max_tokens=2000, ignore_eos=True)
calls = [
    stub.StreamGenerate(pb.StreamGenerateRequest(request_id=i, text="Once upon a time",
                                                 stopping=stopping))
    for i in ids
]
for call in calls:
    next(call)
    threading.Thread(target=lambda c=call: [None for _ in c], daemon=True).start()
print("streaming", flush=True)
time.sleep(600)
"""
KILLED_FREED_WITHIN_S = 3.0


def test_a_sigkilled_client_process_has_its_streams_freed(
    stress_server: ServerProcess, stress_stub: pb_grpc.GenerationServiceStub
) -> None:
    """A client process with three streams mid-generation is SIGKILLed: the server frees their
    sequences and blocks within a few seconds (the core logs each as cancelled) and serves the
    next request."""
    since = len(stress_server.lines)
    ids = [f"killed-client-{i}" for i in range(3)]
    client = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, stress_server.target, *ids],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert client.stdout is not None
    try:
        output: list[str] = []
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while "streaming" not in output and client.poll() is None:
            assert time.monotonic() < deadline, f"the client did not start streaming: {output}"
            if select.select([client.stdout], [], [], 0.1)[0]:
                output.append(client.stdout.readline().strip())
        assert "streaming" in output, output
        stats = stress_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
        assert set(ids) <= {s.request_id for s in stats.slots}, stats
        assert stats.active_blocks > 0
    finally:
        os.kill(client.pid, signal.SIGKILL)
        client.wait(10)
        client.stdout.close()
    killed_at = time.monotonic()
    wait_idle(stress_stub, KILLED_FREED_WITHIN_S, free_blocks=True)
    assert time.monotonic() - killed_at < KILLED_FREED_WITHIN_S
    finished = wait_all_finished(stress_server, set(ids))
    for records in finished.values():
        assert records[0]["finish_reason"] == "cancelled"
        assert records[0]["completion_tokens"] < 2000
    reply = stress_stub.Generate(chat_request("Hi", max_tokens=2), timeout=CALL_TIMEOUT_S)
    assert len(reply.token_ids) == 2
    wait_idle(stress_stub, IDLE_TIMEOUT_S, free_blocks=True)
    assert_clean_log(stress_server, since)


# -- 4. a drain under load -----------------------------------------------------------------------

DRAIN_TIMEOUT_S = 5  # the short streams need a few thin-model steps: ample on a loaded machine
DRAIN_SHORT = {f"drain-short-{n}": n for n in (3, 5, 7, 9)}  # finish within the drain
DRAIN_LONG = {f"drain-long-{i}": 2000 for i in range(4)}  # cannot: cancelled at its end
DRAIN_BOUND_S = DRAIN_TIMEOUT_S + 20  # every stream has ended by then, or it hung


@dataclass
class DrainStream:
    request_id: str
    max_tokens: int
    started: threading.Event = field(default_factory=threading.Event)
    messages: list[tuple[float, pb.StreamGenerateResponse]] = field(default_factory=list)
    error: grpc.RpcError | None = None

    def run(self, stub: pb_grpc.GenerationServiceStub) -> None:
        stopping = pb.StoppingCriteria(max_tokens=self.max_tokens, ignore_eos=True)
        request = to_stream(
            chat_request("Tell me a long story.", request_id=self.request_id, stopping=stopping)
        )
        try:
            for message in stub.StreamGenerate(request, timeout=CALL_TIMEOUT_S + DRAIN_BOUND_S):
                self.messages.append((time.monotonic(), message))
                self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.started.set()

    def tokens(self) -> int:
        return sum(len(m.token_ids) for _, m in self.messages)

    def tokens_after(self, moment: float) -> int:
        return sum(len(m.token_ids) for t, m in self.messages if t > moment)


def test_a_drain_under_load_finishes_what_it_can_and_cancels_the_rest(
    stress_server: ServerProcess,
) -> None:
    """SIGTERM while eight streams run, four short enough to finish within --drain-timeout and
    four far too long: the short ones end LENGTH with all their tokens, the long ones keep
    getting tokens until the timeout and then get a final FINISH_REASON_CANCELLED message;
    CacheStats during the drain shows only the long ones running; no stream hangs; the process
    exits 0 with no traceback, and the core logs the end of every request. The module's last
    test: it stops the module's server."""
    server = stress_server
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        long = [DrainStream(rid, n) for rid, n in DRAIN_LONG.items()]
        short = [DrainStream(rid, n) for rid, n in DRAIN_SHORT.items()]
        threads = []
        # The long ones first, so that the short ones are still running at the signal.
        for group in (long, short):
            for s in group:
                threads.append(threading.Thread(target=s.run, args=(stub,), daemon=True))
                threads[-1].start()
            for s in group:
                assert s.started.wait(CALL_TIMEOUT_S), f"{s.request_id} got no first message"
                assert s.error is None, s.error
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.wait_for_record(lambda r: r.get("event") == "draining")
        for t, s in zip(threads[len(long) :], short, strict=True):
            t.join(max(0.0, signalled + DRAIN_TIMEOUT_S - time.monotonic()))
            assert not t.is_alive(), f"{s.request_id} did not finish within the drain"
        # The short ones are gone from the core (their blocks freed), the long ones decode on.
        while True:
            stats = stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
            if {slot.request_id for slot in stats.slots} == set(DRAIN_LONG):
                break
            assert time.monotonic() < signalled + DRAIN_TIMEOUT_S - 0.5, stats
            time.sleep(0.02)
        assert stats.active_sequences == len(DRAIN_LONG) and stats.queued_requests == 0
        for t in threads:
            t.join(max(0.0, signalled + DRAIN_BOUND_S - time.monotonic()))
        hung = [s.request_id for t, s in zip(threads, long + short, strict=True) if t.is_alive()]
        assert not hung, hung
        assert server.wait(30) == 0

    for s in short + long:
        assert s.error is None, (s.request_id, s.error)
        final = s.messages[-1][1]
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for _, m in s.messages[:-1])
        assert final.usage.completion_tokens == s.tokens(), (s.request_id, final.usage)
    for s in short:
        assert s.messages[-1][1].finish_reason == pb.FINISH_REASON_LENGTH, s.request_id
        assert s.tokens() == s.max_tokens
    assert any(s.tokens_after(signalled) for s in short)  # they ran on after the signal
    for s in long:
        end, final = s.messages[-1]
        assert final.finish_reason == pb.FINISH_REASON_CANCELLED, (s.request_id, final)
        assert s.tokens() < s.max_tokens
        assert s.tokens_after(signalled) > 0  # decoding went on during the drain
        assert end - signalled > DRAIN_TIMEOUT_S - 1, "cancelled before the drain timeout"
    records = server.records()
    shutdown = {
        r["request_id"] for r in records if r.get("event") == "request cancelled by shutdown"
    }
    assert shutdown == set(DRAIN_LONG)
    finished = finished_records(server, set(DRAIN_SHORT) | set(DRAIN_LONG))
    assert {k: v[0]["finish_reason"] for k, v in finished.items()} == {
        **dict.fromkeys(DRAIN_SHORT, "length"),
        **dict.fromkeys(DRAIN_LONG, "cancelled"),
    }
    assert all(len(v) == 1 for v in finished.values()), finished
    assert_clean_log(server, 0)
