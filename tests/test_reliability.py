"""Reliability through real gRPC on the embedded model: undecodable requests, request_id reuse
right after a cancel, oversized requests refused by size off the event loop, and a soak (on the
thin random model) whose memory follows the live set rather than the traffic."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from client.errors import error_details
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.common.config import ModelConfig, SchedulingConfig, ServerConfig
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import GENERATION_SERVICE, THIN_MODEL, in_process_server, running_server

pytestmark = [pytest.mark.slow, pytest.mark.model]

LONG = pb.StoppingCriteria(max_tokens=400, ignore_eos=True)
CORRUPT = b"\x08\xff"  # field 1 as a varint that never ends


def _with_bad_utf8(message, good: bytes) -> bytes:
    """`message` serialized, with the string value `good` turned into invalid UTF-8."""
    data = message.SerializeToString()
    assert data.count(good) == 1
    return data.replace(good, b"\xff" + good[1:])


async def _slot_of(aio_stub, request_id: str) -> pb.SlotInfo | None:
    stats = await aio_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
    return next((s for s in stats.slots if s.request_id == request_id), None)


# -- request_id reuse right after a cancel -----------------------------------------------------


async def test_request_id_reused_right_after_a_cancel_is_cancelled_too(server, aio_stub) -> None:
    """Stream A with id X: read one message, cancel; at once stream B with X: read two,
    cancel. Both end cancelled and X's slot is freed (B used to decode on to max_tokens)."""
    request_id = "reliability-reused-id"
    request = to_stream(chat_request("Tell me a long story.", request_id=request_id, stopping=LONG))
    a = aio_stub.StreamGenerate(request)
    await a.read()
    a.cancel()
    b = aio_stub.StreamGenerate(request)
    first, second = await b.read(), await b.read()
    assert first.request_id == second.request_id == request_id
    b.cancel()
    cancelled_at = time.monotonic()
    while (slot := await _slot_of(aio_stub, request_id)) is not None:
        assert time.monotonic() - cancelled_at < 3.0, f"{request_id} still decoding: {slot}"
        await asyncio.sleep(0.05)
    finished = [
        r
        for r in server.records()
        if r.get("event") == "request finished" and r.get("request_id") == request_id
    ]
    assert [r["finish_reason"] for r in finished] == ["cancelled", "cancelled"]
    assert all(r["completion_tokens"] < 50 for r in finished)
    # Nothing runs on: the slot stays gone.
    await asyncio.sleep(0.5)
    assert await _slot_of(aio_stub, request_id) is None


# -- undecodable requests ------------------------------------------------------------------------

UNDECODABLE = [
    ("Generate", CORRUPT, "not a valid mlxserve.v1.GenerateRequest"),
    (
        "Generate",
        _with_bad_utf8(chat_request("Hi there", max_tokens=1), b"Hi there"),
        "chat.messages[0].content is not valid UTF-8",
    ),
    ("StreamGenerate", CORRUPT, "not a valid mlxserve.v1.StreamGenerateRequest"),
    (
        "StreamGenerate",
        _with_bad_utf8(pb.StreamGenerateRequest(request_id="abc", text="x"), b"abc"),
        "request_id is not valid UTF-8",
    ),
    ("CacheStats", CORRUPT, "not a valid mlxserve.v1.CacheStatsRequest"),
    ("GetModelInfo", CORRUPT, "not a valid mlxserve.v1.GetModelInfoRequest"),
    ("Tokenize", CORRUPT, "not a valid mlxserve.v1.TokenizeRequest"),
    ("Tokenize", _with_bad_utf8(pb.TokenizeRequest(text="hello"), b"hello"), "text is not valid"),
]


async def _call_raw(channel: grpc.aio.Channel, rpc: str, payload: bytes) -> grpc.aio.AioRpcError:
    """Send raw bytes as the request of `rpc` (no serializer: they go on the wire as they are)."""
    method = f"/{GENERATION_SERVICE}/{rpc}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if rpc == "StreamGenerate":
            async for _ in channel.unary_stream(method)(payload, timeout=10):
                pass
        else:
            await channel.unary_unary(method)(payload, timeout=10)
    return info.value


async def test_undecodable_requests_get_invalid_argument_and_one_log_line(
    server, aio_channel, aio_stub
) -> None:
    for rpc, payload, reason in UNDECODABLE:
        before = len(server.lines)
        error = await _call_raw(aio_channel, rpc, payload)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, error)
        assert reason in error.details(), (rpc, error.details())
        # One log line, naming the RPC, and no traceback.
        deadline = time.monotonic() + 5
        while len(server.lines) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # anything else it logged would be printed by now
        new = [json.loads(line) for line in server.lines[before:]]
        refused = [r for r in new if r.get("event") == "request rejected"]
        assert len(refused) == 1, new
        assert refused[0]["rpc"] == f"/{GENERATION_SERVICE}/{rpc}"
        assert refused[0]["reason"] == error.details()
        assert refused[0]["code"] == "INVALID_ARGUMENT"
        # A string field that is not UTF-8 is named in a BadRequest field violation too.
        field = reason.split(" is not valid")[0] if " is not valid" in reason else None
        assert refused[0]["field"] == field
        details = error_details(error)
        assert [v.field for v in details.field_violations] == ([field] if field else [])
        assert details.reason == "INVALID_REQUEST"
        assert not any("exception" in r or r["level"] == "error" for r in new), new
    # The server carries on: a well-formed request on the same channel is served.
    info = await aio_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_id


# -- oversized requests --------------------------------------------------------------------------


BIG_TEXT = "word " * 400_000  # 2 MB: under the 4 MiB message limit, over any slot's bound
SIZE_REFUSALS = [
    ("Generate", pb.GenerateRequest(text=BIG_TEXT), "text: the prompt is 2000000 characters"),
    (
        "StreamGenerate",
        to_stream(chat_request(BIG_TEXT)),
        "chat.messages: the prompt's content totals 2000000 characters",
    ),
    (
        "Generate",
        pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[1] * 200_000)),
        "token_ids.ids: the prompt has 200000 ids",
    ),
]


@pytest.mark.parametrize(("rpc", "request_message", "reason"), SIZE_REFUSALS)
async def test_oversized_input_is_refused_by_its_size(
    aio_stub, rpc: str, request_message, reason: str
) -> None:
    """Refused with the size message, which only the check before tokenization gives (after
    it, a long prompt is refused as "prompt is N tokens")."""
    method = getattr(aio_stub, rpc)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if rpc == "StreamGenerate":
            async for _ in method(request_message, timeout=30):
                pass
        else:
            await method(request_message, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(reason), info.value.details()


async def test_a_message_over_max_request_bytes_is_refused_by_grpc(server) -> None:
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(server.target, options=options) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        text = "x" * ((4 << 20) + 1)  # one byte over the default --max-request-bytes
        for call in (
            stub.Generate(pb.GenerateRequest(text=text), timeout=30),
            stub.Tokenize(pb.TokenizeRequest(text=text), timeout=30),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A message just under the limit still reaches the servicer (and its size check).
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(text="x" * ((4 << 20) - 16)), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_tokenize_counts_input_too_big_to_generate_from(aio_stub) -> None:
    """What Generate refuses by its size alone, Tokenize counts (and says it does not fit)."""
    for request in (
        pb.TokenizeRequest(text=BIG_TEXT, count_only=True),
        pb.TokenizeRequest(chat=chat_request(BIG_TEXT).chat, count_only=True),
    ):
        counted = await aio_stub.Tokenize(request, timeout=120)
        assert counted.token_count >= 400_000 and not counted.fits_slot_context
        assert not counted.token_ids and counted.slot_context_tokens > 0


async def test_tokenization_runs_off_the_event_loop(monkeypatch) -> None:
    """The servicer in-process behind a real grpc.aio server: every encode of Generate,
    StreamGenerate (chat) and Tokenize runs on another thread than the event loop's."""
    threads: list[threading.Thread] = []
    async with in_process_server(
        ServerConfig(
            model=ModelConfig(load_format="dummy:tiny"),
            scheduling=SchedulingConfig(max_batch_size=2),
        )
    ) as (
        stub,
        servicer,
    ):
        tok = servicer.model.tokenizer
        encode = tok.encode

        def recording_encode(text: str) -> list[int]:
            threads.append(threading.current_thread())
            return encode(text)

        monkeypatch.setattr(tok, "encode", recording_encode)
        tokenized = await stub.Tokenize(pb.TokenizeRequest(text="Hello world"), timeout=30)
        assert list(tokenized.token_ids) == encode("Hello world")
        one = pb.StoppingCriteria(max_tokens=1)
        reply = await stub.Generate(pb.GenerateRequest(text="Hi", stopping=one), timeout=60)
        assert len(reply.token_ids) == 1
        stream = to_stream(chat_request("Hi", max_tokens=1))
        assert [m async for m in stub.StreamGenerate(stream, timeout=60)]
    assert len(threads) == 3
    loop_thread = threading.current_thread()
    assert all(t is not loop_thread for t in threads), [t.name for t in threads]


# -- soak: memory follows the live set, not the traffic ------------------------------------------

# Each request caches one block of its own (its number's): past the pool's initial 64 blocks an
# allocator that grew the arrays for cached prefixes instead of reusing them would show here,
# with room to spare.
SOAK_REQUESTS = 128
SOAK_CONCURRENCY = 8


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
async def test_soak_of_distinct_requests_keeps_memory_to_the_live_set() -> None:
    """Over a hundred short distinct chat requests (each caches its own prompt blocks): the
    server's RSS grows by less than 100 MB and the pool's arrays stay within twice the peak of
    blocks in use or their initial size (they used to double with the traffic). The weights
    play no part: the thin random model (the embedded tokenizer's prompts, 30 layers of KV)."""
    flags = ("--max-batch-size", "8", "--log-format", "json", *THIN_MODEL)
    with running_server(*flags) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            initial = await stub.CacheStats(pb.CacheStatsRequest(), timeout=10)
            assert initial.budget_bytes and initial.total_blocks
            block_bytes = initial.budget_bytes // initial.total_blocks

            async def one(i: int) -> pb.GenerateResponse:
                request = chat_request(f"Fact {i}?", max_tokens=2)
                return await stub.Generate(request, timeout=300)

            async def run(first: int, count: int) -> list[pb.GenerateResponse]:
                gate = asyncio.Semaphore(SOAK_CONCURRENCY)

                async def gated(i: int) -> pb.GenerateResponse:
                    async with gate:
                        return await one(i)

                return await asyncio.gather(*(gated(i) for i in range(first, first + count)))

            await run(-SOAK_CONCURRENCY, SOAK_CONCURRENCY)  # first-use buffers are no leak
            rss_before = _rss_mb(server.proc.pid)
            peak_active = 0
            polling = True

            async def poll() -> None:
                nonlocal peak_active
                while polling:
                    stats = await stub.CacheStats(pb.CacheStatsRequest(), timeout=10)
                    peak_active = max(peak_active, stats.active_blocks)
                    await asyncio.sleep(0.02)

            poller = asyncio.create_task(poll())
            replies = await run(0, SOAK_REQUESTS)
            polling = False
            await poller
            after = await stub.CacheStats(pb.CacheStatsRequest(), timeout=10)
            rss_growth = _rss_mb(server.proc.pid) - rss_before

    assert len(replies) == SOAK_REQUESTS
    assert all(len(r.token_ids) >= 1 and r.finish_reason for r in replies)
    assert after.active_sequences == 0 and after.active_blocks == 0
    assert after.cached_blocks > 0  # the prefix cache still works, inside the arrays
    assert peak_active > 0
    # reserved_bytes: the arrays' blocks plus one scratch block (the decode mirror is empty
    # once nothing runs).
    capacity = after.reserved_bytes // block_bytes - 1
    initial_capacity = initial.reserved_bytes // block_bytes - 1
    assert capacity <= max(initial_capacity, 2 * peak_active), (capacity, peak_active)
    assert rss_growth < 100, f"RSS grew {rss_growth:.0f} MB over {SOAK_REQUESTS} requests"


# -- drain ---------------------------------------------------------------------------------------


def _long_stream(stub: pb_grpc.GenerationServiceStub, request_id: str):
    request = to_stream(
        chat_request(
            "Tell me a long story.",
            request_id=request_id,
            stopping=pb.StoppingCriteria(max_tokens=2000, ignore_eos=True),
        )
    )
    call = stub.StreamGenerate(request, timeout=120)
    next(call)
    return call


def test_a_drain_ends_what_outlives_its_timeout_as_cancelled() -> None:
    """SIGTERM with --drain-timeout 1 while a long stream runs: new calls get UNAVAILABLE with
    RetryInfo at once; when the timeout passes the stream gets a final message with
    FINISH_REASON_CANCELLED (status OK), the log says it was cancelled by shutdown (no
    traceback), its KV is freed, and the process exits 0."""
    with running_server("--drain-timeout", "1", "--log-format", "json") as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            call = _long_stream(stub, "drain-late")
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            server.wait_for_record(lambda r: r.get("event") == "draining")
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(chat_request("Hi", max_tokens=1), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            details = error_details(info.value)
            assert details.retry_delay == 1.0 and details.reason == "DRAINING"
            rest = list(call)
            assert rest[-1].finish_reason == pb.FINISH_REASON_CANCELLED
            assert rest[-1].usage.completion_tokens == 1 + sum(len(m.token_ids) for m in rest)
            assert 0.9 < time.monotonic() - started < 10
        assert server.wait(30) == 0
    records = server.records()
    assert any(
        r.get("event") == "request cancelled by shutdown" and r["request_id"] == "drain-late"
        for r in records
    )
    assert not any("Traceback" in line for line in server.lines)
    finished = [r for r in records if r.get("event") == "request finished"]
    assert finished and finished[-1]["finish_reason"] == "cancelled"


def test_a_second_signal_stops_at_once() -> None:
    """--drain-timeout 60, but a second SIGTERM: the running stream ends at once (cancelled)
    and the process exits 0 without waiting out the drain."""
    with (
        running_server("--drain-timeout", "60", "--log-format", "json") as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        call = _long_stream(pb_grpc.GenerationServiceStub(channel), "drain-twice")
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.wait_for_record(lambda r: r.get("event") == "draining")
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0
        assert time.monotonic() - started < 20
        try:
            assert list(call)[-1].finish_reason == pb.FINISH_REASON_CANCELLED
        except grpc.RpcError as exc:  # or cut by the stopping server: never left hanging
            assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
