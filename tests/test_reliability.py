"""Reliability through real gRPC on the embedded model: undecodable requests, request_id reuse
right after a cancel, oversized requests refused by size off the event loop, and a soak whose
memory follows the live set rather than the traffic."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import chat_request, to_stream

from mlxserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.model

LONG = pb.StoppingCriteria(max_tokens=400, ignore_eos=True)


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
