"""Request lifecycle through real gRPC: client cancel and deadlines end the sequence as
cancelled within about a tick and free its slot, without disturbing the other requests."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from client.errors import error_details
from mlxserve.v1 import generation_pb2 as pb
from tests.helpers.requests import chat_request, to_stream, with_id

pytestmark = [pytest.mark.slow, pytest.mark.model]

# Requests that would run for a long time if nothing stopped them.
LONG = pb.StoppingCriteria(max_tokens=400, ignore_eos=True)
BYSTANDERS = [
    chat_request("What is the capital of France?", max_tokens=16),
    chat_request("Name three fruits.", max_tokens=14),
]


async def _wait_idle(aio_stub, timeout: float) -> float:
    """Poll CacheStats until no sequence is active; returns the seconds it took."""
    started = time.monotonic()
    while True:
        stats = await aio_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
        if stats.active_sequences == 0 and stats.queued_requests == 0:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"still active after {timeout} s: {stats}")
        await asyncio.sleep(0.05)


async def _bystanders(aio_stub, tag: str) -> list[pb.GenerateResponse]:
    calls = [
        aio_stub.Generate(with_id(r, f"{tag}-bystander-{i}"), timeout=120)
        for i, r in enumerate(BYSTANDERS)
    ]
    return await asyncio.gather(*calls)


def _assert_unaffected(results: list[pb.GenerateResponse], reference) -> None:
    for request, got in zip(BYSTANDERS, results):
        expected = reference(request)
        assert list(got.token_ids) == list(expected.token_ids)
        assert got.text == expected.text
        assert got.finish_reason == expected.finish_reason


async def test_stream_cancel_frees_the_slot(server, aio_stub, reference) -> None:
    for r in BYSTANDERS:
        reference(r)  # expected tokens, computed alone beforehand
    await _wait_idle(aio_stub, 10)
    request_id = "lifecycle-stream-cancel"
    call = aio_stub.StreamGenerate(
        to_stream(chat_request("Tell me a long story.", request_id=request_id, stopping=LONG))
    )
    bystanders = asyncio.ensure_future(_bystanders(aio_stub, "stream"))
    first = await call.read()
    assert len(first.token_ids) == 1 and first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    # Cancel once all three decode together (not in the middle of the bystanders' prefill).
    while True:
        stats = await aio_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
        decoding = [s for s in stats.slots if s.state == pb.SLOT_STATE_DECODING]
        if len(decoding) == 3:
            break
        assert not bystanders.done(), "the bystanders finished before the three overlapped"
        await asyncio.sleep(0.02)
    call.cancel()
    cancelled_at = time.monotonic()

    # The slot is freed within about one tick (polled until only the bystanders remain).
    while True:
        stats = await aio_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
        if request_id not in {s.request_id for s in stats.slots}:
            break
        assert time.monotonic() - cancelled_at < 1.5, "cancelled sequence still running"
        await asyncio.sleep(0.02)
    record = server.finished_record(request_id)
    assert record["finish_reason"] == "cancelled"
    assert record["completion_tokens"] < 50

    _assert_unaffected(await bystanders, reference)
    assert await _wait_idle(aio_stub, 5) < 5


async def test_stream_cancel_alone_returns_to_idle_within_a_second(server, aio_stub) -> None:
    await _wait_idle(aio_stub, 10)
    request_id = "lifecycle-stream-cancel-alone"
    call = aio_stub.StreamGenerate(
        to_stream(chat_request("Tell me a long story.", request_id=request_id, stopping=LONG))
    )
    await call.read()
    call.cancel()
    assert await _wait_idle(aio_stub, 1.0) <= 1.0
    assert server.finished_record(request_id)["finish_reason"] == "cancelled"


async def test_unary_deadline_cancels_the_sequence(server, aio_stub, reference) -> None:
    for r in BYSTANDERS:
        reference(r)
    await _wait_idle(aio_stub, 10)
    request_id = "lifecycle-deadline"
    bystanders = asyncio.ensure_future(_bystanders(aio_stub, "deadline"))
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await aio_stub.Generate(
            chat_request("Tell me a long story.", request_id=request_id, stopping=LONG),
            timeout=0.5,
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2.0
    record = server.finished_record(request_id, timeout=3)
    assert record["finish_reason"] == "cancelled"
    _assert_unaffected(await bystanders, reference)
    await _wait_idle(aio_stub, 5)


async def test_unary_client_cancel_ends_the_sequence(server, aio_stub) -> None:
    await _wait_idle(aio_stub, 10)
    request_id = "lifecycle-unary-cancel"
    call = aio_stub.Generate(
        chat_request("Tell me a long story.", request_id=request_id, stopping=LONG)
    )
    # Wait until it is running, then walk away.
    deadline = time.monotonic() + 10
    while True:
        stats = await aio_stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
        if any(s.request_id == request_id and s.generated_tokens > 0 for s in stats.slots):
            break
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await _wait_idle(aio_stub, 1.5) <= 1.5
    assert server.finished_record(request_id)["finish_reason"] == "cancelled"


def test_duplicate_running_request_id_is_refused(server, stub) -> None:
    request_id = "lifecycle-duplicate"
    stream = stub.StreamGenerate(
        to_stream(chat_request("Tell me a long story.", request_id=request_id, stopping=LONG))
    )
    try:
        next(stream)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(chat_request("Hi", request_id=request_id, max_tokens=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert request_id in info.value.details()
        assert error_details(info.value).reason == "REQUEST_ID_IN_USE"
    finally:
        stream.cancel()
    # One log line for the refusal: its code, the field at fault and the request id.
    record = server.wait_for_record(
        lambda r: r.get("event") == "request rejected" and r.get("request_id") == request_id
    )
    assert (record["code"], record["field"]) == ("ALREADY_EXISTS", "request_id")
