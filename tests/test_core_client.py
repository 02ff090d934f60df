"""The core client (service.frontend.core_client): its wake-ups (one message per step while few
streams run; under load, each stream in its turn every few ticks, its first tokens and its end
at once, and nothing held once the ticks stop) and its sends (one message per loop iteration)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq

from service import protocol
from service.frontend import core_client
from service.frontend.core_client import CoreClient
from service.protocol import GenerationRequest


class FakeStream:
    def __init__(self, rid: int, urgent: bool = False) -> None:
        self.rid = rid
        self.urgent = urgent
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1


def streams(n: int) -> dict[int, FakeStream]:
    return {rid: FakeStream(rid) for rid in range(n)}


def test_few_streams_are_woken_every_tick(tmp_path: Path) -> None:
    client = CoreClient(tmp_path, 0)
    running = streams(core_client.ROWS_PER_TICK)
    for _ in range(3):
        client._wake(dict(running))  # type: ignore[arg-type]
    assert all(s.wakes == 3 for s in running.values())
    assert not client._held


def test_under_load_each_stream_wakes_in_its_turn(tmp_path: Path) -> None:
    client = CoreClient(tmp_path, 0)
    n = 2 * core_client.ROWS_PER_TICK + 1  # every third tick
    running = streams(n)
    running[5].urgent = True  # its first tokens (or its end): never held
    woken_per_tick = []
    for _ in range(3):
        before = sum(s.wakes for s in running.values())
        client._wake(dict(running))  # type: ignore[arg-type]
        woken_per_tick.append(sum(s.wakes for s in running.values()) - before)
    # Three ticks: each stream woken once (the urgent one each time), a third of them per tick.
    assert running[5].wakes == 3
    assert all(s.wakes == 1 for rid, s in running.items() if rid != 5)
    assert all(abs(w - n / 3) <= 2 for w in woken_per_tick), woken_per_tick
    # A tick that held streams, then none: the held streams go out (the reader's timeout).
    client._wake(dict(running))  # type: ignore[arg-type]
    assert client._held
    client._wake_held()
    assert not client._held and all(s.wakes == 2 for rid, s in running.items() if rid != 5)


def test_a_held_stream_goes_out_in_its_turn_without_tokens_of_its_own(tmp_path: Path) -> None:
    """A stream held on one tick and absent from the next ones (preempted, say) is still woken
    when its turn comes while other streams keep the ticks going."""
    client = CoreClient(tmp_path, 0)
    n = 3 * core_client.ROWS_PER_TICK  # every third tick
    running = streams(n)
    client._wake(dict(running))  # type: ignore[arg-type]
    held = [rid for rid, s in running.items() if s.wakes == 0]
    others = {rid: FakeStream(rid) for rid in range(n, 2 * n)}
    for _ in range(2):
        client._wake(dict(others))  # type: ignore[arg-type]
    assert all(running[rid].wakes == 1 for rid in held)


def test_a_closed_stream_is_not_held(tmp_path: Path) -> None:
    client = CoreClient(tmp_path, 0)
    client._held[7] = FakeStream(7)  # type: ignore[assignment]
    client._streams[7] = client._held[7]  # type: ignore[assignment]
    client._request_ids.add("r")

    class Request:
        request_id = "r"

    stream = client._held[7]
    stream.request = Request()  # type: ignore[attr-defined]
    stream.ended = True  # type: ignore[attr-defined]
    client.close(stream)  # type: ignore[arg-type]
    assert not client._held


async def test_held_tokens_go_out_when_no_tick_comes(tmp_path: Path) -> None:
    """The output reader, with streams held and no tick arriving (a paused core): they are
    woken after MAX_HOLD_S, not left waiting for the next tick."""
    client = CoreClient(tmp_path, 0)
    client._pull = client._context.socket(zmq.PULL)
    client._pull.bind(f"ipc://{tmp_path / 'outputs'}")
    held = FakeStream(3)
    client._held[3] = held  # type: ignore[assignment]
    started = time.monotonic()
    reader = asyncio.ensure_future(client._read_outputs())
    try:
        while not held.wakes and time.monotonic() - started < 5:
            await asyncio.sleep(0.01)
        assert held.wakes == 1 and not client._held
        assert time.monotonic() - started >= core_client.MAX_HOLD_S * 0.9
    finally:
        reader.cancel()
        await client.close_sockets()


async def test_what_one_loop_iteration_queues_reaches_the_core_as_one_message(
    tmp_path: Path,
) -> None:
    """A burst's requests and aborts, queued in one event-loop iteration, leave as one ZeroMQ
    message that the core decodes into the same messages in the same order; the next
    iteration's go in the next message."""
    client = CoreClient(tmp_path, 0)
    router = client._context.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path / 'core'}")
    client._dealer = client._context.socket(zmq.DEALER)
    client._dealer.connect(f"ipc://{tmp_path / 'core'}")
    try:
        requests = [GenerationRequest(f"r{i}", (1, 2, i)) for i in range(3)]
        for i, request in enumerate(requests):
            client._send_now(protocol.Add(i, request))
        client._send_now(protocol.Abort(1))
        await asyncio.sleep(0)  # the iteration ends: the queued messages go out
        client._send_now(protocol.Abort(2))
        await asyncio.sleep(0)
        batches = []
        for _ in range(2):
            assert await router.poll(5000)
            _peer, data = await router.recv_multipart()
            batches.append(protocol.decode_to_core(data))
        assert batches[0] == [
            *(protocol.Add(i, r) for i, r in enumerate(requests)),
            protocol.Abort(1),
        ]
        assert batches[1] == [protocol.Abort(2)]
        assert not client._outbox
    finally:
        router.close(linger=0)
        await client.close_sockets()
