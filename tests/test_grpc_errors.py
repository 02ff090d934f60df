"""Errors through real gRPC: bad input, overload, an injected engine fault, graceful stop.

Validation runs on the shared server. Overload, the slot-context limit and fault isolation
run on one small server of this module (queue depth 2, 4 slots of 512 tokens, and the test
fault hook: every evaluation of a request whose id contains "boom" fails); its last test
stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.errors import error_details
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import ServerProcess, running_server, wait_idle, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.model]

VOCAB = 49152
BUSY = "Server is busy. Retry later."
BACKEND_ERROR = "inference backend error"


def _hi(**fields) -> pb.GenerateRequest:
    return chat_request("Hi", max_tokens=1, **fields)


# Each bad request, and the path of the field at fault (the BadRequest field violation).
INVALID = {
    "no-input": (pb.GenerateRequest(), "input"),
    "empty-text": (pb.GenerateRequest(text=""), "text"),
    "empty-token-ids": (pb.GenerateRequest(token_ids=pb.TokenIdsInput()), "token_ids.ids"),
    "empty-chat": (pb.GenerateRequest(chat=pb.ChatInput()), "chat.messages"),
    "unknown-role": (
        pb.GenerateRequest(
            chat=pb.ChatInput(messages=[pb.ChatMessage(role="wizard", content="x")])
        ),
        "chat.messages[0].role",
    ),
    "temperature-negative": (
        _hi(sampling=pb.SamplingParams(temperature=-1)),
        "sampling.temperature",
    ),
    "top-p-zero": (_hi(sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    "top-p-above-one": (_hi(sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    "min-p-above-one": (_hi(sampling=pb.SamplingParams(min_p=2)), "sampling.min_p"),
    "top-k-negative": (_hi(sampling=pb.SamplingParams(top_k=-1)), "sampling.top_k"),
    "repetition-penalty-zero": (
        _hi(sampling=pb.SamplingParams(repetition_penalty=0)),
        "sampling.repetition_penalty",
    ),
    "token-id-outside-vocab": (
        pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[1, 2, VOCAB])),
        "token_ids.ids[2]",
    ),
    "logit-bias-key-outside-vocab": (
        _hi(sampling=pb.SamplingParams(logit_bias={VOCAB + 5: 1.0})),
        f"sampling.logit_bias[{VOCAB + 5}]",
    ),
    "logit-bias-value-out-of-range": (
        _hi(sampling=pb.SamplingParams(logit_bias={7: 1000.0})),
        "sampling.logit_bias[7]",
    ),
    "max-tokens-zero": (
        chat_request("Hi", stopping=pb.StoppingCriteria(max_tokens=0)),
        "stopping.max_tokens",
    ),
    "stop-token-outside-vocab": (
        _hi(stopping=pb.StoppingCriteria(max_tokens=1, stop_token_ids=[VOCAB])),
        "stopping.stop_token_ids[0]",
    ),
    "top-logprobs-without-logprobs": (_hi(top_logprobs=3), "top_logprobs"),
    "top-logprobs-too-many": (_hi(logprobs=True, top_logprobs=21), "top_logprobs"),
}


def assert_names_the_field(error: grpc.RpcError, field: str) -> None:
    """INVALID_ARGUMENT whose message names the field, with a BadRequest field violation
    giving its exact path (what a client reads to point at it)."""
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field.split("[")[0] in error.details()
    details = error_details(error)
    assert [(v.field, v.description) for v in details.field_violations] == [
        (field, error.details())
    ]
    assert details.reason == "INVALID_REQUEST" and details.retry_delay is None


@pytest.mark.parametrize("case", INVALID.values(), ids=INVALID.keys())
def test_invalid_argument_names_the_field(stub, case) -> None:
    request, field = case
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=10)
    assert_names_the_field(info.value, field)


@pytest.mark.parametrize("key", ["unknown-role", "top-p-zero", "max-tokens-zero"])
def test_stream_invalid_argument_names_the_field(stub, key: str) -> None:
    request, field = INVALID[key]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamGenerate(to_stream(request), timeout=10))
    assert_names_the_field(info.value, field)


def test_tokenize_invalid_argument_names_the_field(stub) -> None:
    request = pb.TokenizeRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="x")]))
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(request, timeout=10)
    assert_names_the_field(info.value, "chat.messages[0].role")


def test_each_rejected_request_leaves_one_log_line(server, stub) -> None:
    """Code, field and request id; nothing of the prompt."""
    rid = "bad-temperature-7"
    request = _hi(request_id=rid, sampling=pb.SamplingParams(temperature=-3))
    with pytest.raises(grpc.RpcError):
        stub.Generate(request, timeout=10)
    record = server.wait_for_record(
        lambda r: r.get("event") == "request rejected" and r.get("request_id") == rid
    )
    assert record["code"] == "INVALID_ARGUMENT"
    assert record["field"] == "sampling.temperature"
    assert record["level"] == "info"
    assert len([r for r in server.records() if r.get("request_id") == rid]) == 1


def test_server_still_serves_after_bad_requests(stub) -> None:
    r = stub.Generate(_hi(), timeout=60)
    assert len(r.token_ids) == 1


# -- the small server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> Iterator[ServerProcess]:
    with running_server(
        "--max-batch-size", "4",
        "--ctx-size", "2048",  # 4 slots of 512 tokens
        "--max-queue-depth", "2",
        "--log-format", "json",
        env={"MLXSERVE_INJECT_FAULT": "boom,build:crash"},
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def small_stub(small: ServerProcess) -> Iterator[pb_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(small.target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def _stats(small: ServerProcess) -> pb.CacheStatsResponse:
    with grpc.insecure_channel(small.target) as channel:
        return pb_grpc.GenerationServiceStub(channel).CacheStats(pb.CacheStatsRequest(), timeout=5)


def _wait_idle(small: ServerProcess, timeout: float = 10.0) -> None:
    with grpc.insecure_channel(small.target) as channel:
        wait_idle(pb_grpc.GenerationServiceStub(channel), timeout)


def test_slot_context_is_ctx_size_over_batch(small_stub) -> None:
    stats = small_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
    assert stats.slot_context_tokens == 512
    assert stats.max_batch_size == 4


@pytest.mark.parametrize(
    "request_",
    [
        pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[504] * 600)),
        pb.GenerateRequest(text="The quick brown fox jumps over the lazy dog. " * 60),
        pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[504] * 512)),  # no room for 1 token
    ],
    ids=["600-token-ids", "long-text", "exactly-slot"],
)
def test_prompt_longer_than_the_slot_is_refused(small_stub, request_) -> None:
    with pytest.raises(grpc.RpcError) as info:
        small_stub.Generate(request_, timeout=10)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
    assert "prompt" in info.value.details()
    assert "512" in info.value.details()


def test_tokenize_counts_a_text_longer_than_the_slot(small_stub) -> None:
    """Tokenize answers "how many tokens is this?" for any text the transport accepts, and
    says whether a Generate with it would fit the slot context."""
    long_text = (
        "The quick brown fox jumps over the lazy dog. " * 600
    )  # far over 512 * longest token
    full = small_stub.Tokenize(pb.TokenizeRequest(text=long_text), timeout=60)
    assert full.token_count == len(full.token_ids) == len(full.tokens) > 512
    assert not full.fits_slot_context and full.slot_context_tokens == 512
    counted = small_stub.Tokenize(pb.TokenizeRequest(text=long_text, count_only=True), timeout=60)
    assert counted.token_count == full.token_count and not counted.token_ids
    assert not counted.tokens and not counted.fits_slot_context
    short = small_stub.Tokenize(pb.TokenizeRequest(text="Hello world"), timeout=10)
    assert short.fits_slot_context and short.token_count == len(short.token_ids) > 0


async def test_overload_rejects_at_once_and_drops_nothing_admitted(small) -> None:
    _wait_idle(small)
    max_tokens = 8
    stopping = pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    request = chat_request("Tell me a long story.", stopping=stopping)
    async with grpc.aio.insecure_channel(small.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        async def one(i: int) -> tuple[float, object]:
            started = time.monotonic()
            r = pb.GenerateRequest()
            r.CopyFrom(request)
            r.request_id = f"overload-{i}"
            try:
                result: object = await stub.Generate(r, timeout=120)
            except grpc.aio.AioRpcError as exc:
                result = exc
            return time.monotonic() - started, result

        results = await asyncio.gather(*(one(i) for i in range(8)))

    rejected = [(t, r) for t, r in results if isinstance(r, grpc.aio.AioRpcError)]
    completed = [r for _, r in results if isinstance(r, pb.GenerateResponse)]
    assert rejected, "8 requests on 4 slots + a queue of 2: some must be refused"
    assert completed, "the admitted requests must run"
    assert len(rejected) + len(completed) == 8
    for elapsed, exc in rejected:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert exc.details() == BUSY
        assert elapsed < 2.0, "a full queue is refused at once"
        details = error_details(exc)  # come back in a second
        assert details.reason == "QUEUE_FULL" and details.retry_delay == 1.0
    # One log line for each refusal, naming the request.
    refused = [
        r
        for r in small.records()
        if r.get("event") == "request rejected" and (r["request_id"] or "").startswith("overload")
    ]
    rejected_ids = {f"overload-{i}" for i in range(8)} - {r.request_id for r in completed}
    assert sorted(r["request_id"] for r in refused) == sorted(rejected_ids)
    assert {(r["code"], r["level"]) for r in refused} == {("RESOURCE_EXHAUSTED", "warning")}
    for r in completed:  # nothing admitted is dropped
        assert r.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(r.token_ids) == max_tokens
    assert len({tuple(r.token_ids) for r in completed}) == 1  # same greedy request, same tokens
    _wait_idle(small)


def test_fault_is_isolated_to_its_request(small, small_stub) -> None:
    _wait_idle(small)
    normal = [
        chat_request("What is the capital of France?", max_tokens=6, request_id="fault-ok-1"),
        chat_request("Name three fruits.", max_tokens=6, request_id="fault-ok-2"),
    ]
    boom = chat_request("Tell me a story.", max_tokens=6, request_id="req-boom-1")
    results: dict[str, object] = {}

    def run(request: pb.GenerateRequest) -> None:
        try:
            results[request.request_id] = small_stub.Generate(request, timeout=120)
        except grpc.RpcError as exc:
            results[request.request_id] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (normal[0], boom, normal[1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    failed = results["req-boom-1"]
    assert isinstance(failed, grpc.RpcError), failed
    assert failed.code() == grpc.StatusCode.INTERNAL
    assert failed.details() == BACKEND_ERROR
    record = small.finished_record("req-boom-1")
    assert record["finish_reason"] == "error"

    # The others complete normally, with the tokens they give alone afterwards.
    for request in normal:
        got = results[request.request_id]
        assert isinstance(got, pb.GenerateResponse), got
        assert got.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert len(got.token_ids) > 0
        alone = small_stub.Generate(chat_request(request.chat.messages[0].content, max_tokens=6))
        assert list(got.token_ids) == list(alone.token_ids)
    _wait_idle(small)
    assert _stats(small).active_sequences == 0


def test_build_fault_ends_only_its_request_and_leaves_the_pool_consistent(
    small, small_stub
) -> None:
    """A failure while a batched step's graph is built (model code raising for one row) ends
    that request only: the others, prefilled and decoded in the same steps, finish with the
    tokens they give alone; no KV block is left behind; the failure is not counted as a
    completion."""
    _wait_idle(small)
    before = _stats(small)
    normal = [
        chat_request("What is the capital of France?", max_tokens=8, request_id="build-ok-1"),
        chat_request("Name three fruits.", max_tokens=8, request_id="build-ok-2"),
    ]
    crash = chat_request("Tell me a story.", max_tokens=8, request_id="req-crash-1")
    futures = {r.request_id: small_stub.Generate.future(r, timeout=120) for r in [*normal, crash]}
    with pytest.raises(grpc.RpcError) as info:
        futures["req-crash-1"].result()
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == BACKEND_ERROR
    for request in normal:
        got = futures[request.request_id].result()
        alone = small_stub.Generate(chat_request(request.chat.messages[0].content, max_tokens=8))
        assert list(got.token_ids) == list(alone.token_ids)
    _wait_idle(small)
    after = _stats(small)
    assert after.active_blocks == 0
    assert after.total_failed == before.total_failed + 1
    assert after.total_completed == before.total_completed + 4  # 2 batched + 2 alone


def test_repeated_engine_failures_turn_health_not_serving(small, small_stub) -> None:
    """Every row of several steps in a row failing means the engine, not a request, is broken:
    health says NOT_SERVING (so a balancer stops sending traffic); a good step restores it."""
    _wait_idle(small)
    with grpc.insecure_channel(small.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def status() -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

        assert status() == health_pb2.HealthCheckResponse.SERVING
        for i in range(3):
            request = chat_request("Hi", max_tokens=2, request_id=f"req-crash-seq-{i}")
            with pytest.raises(grpc.RpcError):
                small_stub.Generate(request, timeout=60)
        serving_status = health_pb2.HealthCheckResponse
        wait_until(lambda: status() == serving_status.NOT_SERVING, "health to turn NOT_SERVING", 5)
        small_stub.Generate(chat_request("Hi", max_tokens=2), timeout=60)
        wait_until(lambda: status() == serving_status.SERVING, "health to recover", 5)


def test_fault_on_a_stream_ends_it_with_internal(small, small_stub) -> None:
    request = chat_request("Tell me a story.", max_tokens=10, request_id="stream-boom-2")
    with pytest.raises(grpc.RpcError) as info:
        list(small_stub.StreamGenerate(to_stream(request), timeout=60))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == BACKEND_ERROR
    after = small_stub.Generate(chat_request("Hi", max_tokens=2), timeout=60)
    assert len(after.token_ids) == 2  # the server keeps serving


def test_sigterm_stops_gracefully(small, small_stub) -> None:
    """Last test of the module: SIGTERM while a request runs. The request finishes, the
    process exits with code 0 within 15 s."""
    _wait_idle(small)
    stream = small_stub.StreamGenerate(
        to_stream(
            chat_request(
                "Tell me a story.",
                request_id="drain-1",
                stopping=pb.StoppingCriteria(max_tokens=10, ignore_eos=True),
            )
        ),
        timeout=60,
    )
    first = next(stream)
    started = time.monotonic()
    small.proc.send_signal(signal.SIGTERM)
    # Draining: health turns NOT_SERVING and new requests are refused as UNAVAILABLE ...
    with grpc.insecure_channel(small.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                break
            if status != health_pb2.HealthCheckResponse.SERVING:
                break
            assert time.monotonic() - started < 5, "still SERVING after SIGTERM"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.GenerationServiceStub(channel).Generate(
                chat_request("Hi", max_tokens=1), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(stream)  # ... while the in-flight request is drained, not dropped
    tokens = [t for m in [first, *rest] for t in m.token_ids]
    assert len(tokens) == 10
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    try:
        code = small.wait(timeout=max(0.1, 15 - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit within 15 s of SIGTERM")
    assert code == 0, "\n".join(small.lines[-20:])
    assert time.monotonic() - started < 15
    events = [r.get("event") for r in small.records()]
    assert "draining" in events and "stopped" in events
