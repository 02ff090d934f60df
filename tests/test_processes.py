"""The server's processes: an engine core (the only one with MLX) and gRPC front ends.

Real servers on the embedded model: the front end has no MLX mapped; several front ends share
the port; a slow stream gets several steps per message without slowing the others; a core
that dies ends every open RPC with UNAVAILABLE, turns health NOT_SERVING and makes the server
exit non-zero, never leaving an RPC hanging; under load, each message carries several steps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.frontend.core_client import ROWS_PER_TICK
from tests.helpers.metrics import EMBEDDED_MODEL_ID, metric, scrape_metrics
from tests.helpers.processes import children, core_of, maps_mlx
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import (
    GENERATION_SERVICE,
    ServerProcess,
    free_port,
    running_server,
    start_server,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc"),
]


def test_only_the_engine_core_imports_mlx(server: ServerProcess) -> None:
    """On the session's server (a plain launch of the embedded model)."""
    assert not maps_mlx(server.proc.pid), "the front end mapped MLX"
    core = core_of(server.proc.pid)
    assert core != server.proc.pid
    with grpc.insecure_channel(server.target) as channel:
        reply = pb_grpc.GenerationServiceStub(channel).Generate(
            chat_request("What is the capital of France?", max_tokens=8), timeout=60
        )
        assert "Paris" in reply.text
    assert not maps_mlx(server.proc.pid)


def test_front_ends_share_the_port() -> None:
    """--api-workers 2: two front-end processes answer on one port (new connections spread
    over them by the kernel), and both reach the one engine core. Front end 0's /metrics
    counts the requests of both (prometheus-client's multiprocess mode). Front end 1 starts
    listening only once it serves: no connection can reach it while the model loads."""
    metrics_port = free_port()
    flags = ("--api-workers", "2", "--log-format", "json", "--metrics-port", str(metrics_port))
    with running_server(*flags) as server:
        server.wait_for_record(
            lambda r: r.get("event") == "serving" and r.get("frontend") == 1, timeout=60
        )
        fe1 = [r["event"] for r in server.records() if r.get("frontend") == 1]
        assert not any(event.startswith("listening") for event in fe1), fe1
        served_by: set[int] = set()
        for i in range(16):
            with grpc.insecure_channel(
                server.target, options=[("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                stub.Generate(chat_request(f"Say {i}.", max_tokens=1, request_id=f"w{i}"))
            record = server.wait_for_record(
                lambda r, i=i: r.get("event") == "request queued" and r["request_id"] == f"w{i}"
            )
            served_by.add(record["frontend"])
            if len(served_by) == 2:
                break
        assert served_by == {"fe0", "fe1"}
        with_mlx = [p for p in [server.proc.pid, *children(server.proc.pid)] if maps_mlx(p)]
        assert len(with_mlx) == 1  # one engine core for both
        samples = scrape_metrics(f"http://127.0.0.1:{metrics_port}/metrics")
        sent = i + 1
        model = {"model": EMBEDDED_MODEL_ID}
        assert metric(samples, "mlxserve_requests_total", **model, finish_reason="length") == sent
        assert metric(samples, "mlxserve_generation_tokens_total", **model) == sent
        rpc = {"grpc_service": GENERATION_SERVICE, "grpc_method": "Generate", "grpc_type": "unary"}
        assert metric(samples, "grpc_server_handled_total", **rpc, grpc_code="OK") == sent
        assert metric(samples, "mlxserve_num_requests_running", **model) == 0


def test_a_slow_consumer_gets_several_steps_per_message_and_slows_no_one(
    server: ServerProcess,
) -> None:
    """A stream read slowly has its tokens coalesced (fewer messages than tokens, same text as
    read at full speed); a stream read normally beside it keeps one message per step and
    finishes long before the slow reader is done. On the session's server."""
    # Longer than the fast stream (20 tokens), which runs beside it while nobody reads it.
    request = to_stream(chat_request("Write a story about a cat.", max_tokens=24))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        want = stub.Generate(chat_request("Write a story about a cat.", max_tokens=24))
        slow_messages: list[pb.StreamGenerateResponse] = []
        fast_done = threading.Event()
        fast_messages: list[pb.StreamGenerateResponse] = []

        def fast() -> None:
            stopping = pb.StoppingCriteria(max_tokens=20, ignore_eos=True)
            req = to_stream(chat_request("Name three fruits.", stopping=stopping))
            fast_messages.extend(stub.StreamGenerate(req, timeout=120))
            fast_done.set()

        # A receive window of a few messages: the server's writes wait for this reader.
        slow_channel = grpc.insecure_channel(
            server.target,
            options=[("grpc.http2.lookahead_bytes", 64), ("grpc.http2.bdp_probe", 0)],
        )
        call = pb_grpc.GenerationServiceStub(slow_channel).StreamGenerate(request, timeout=120)
        slow_messages.append(next(call))
        thread = threading.Thread(target=fast)
        thread.start()
        time.sleep(3.0)  # the engine runs on while nobody reads this stream
        assert fast_done.wait(60)
        slow_messages.extend(call)
        slow_channel.close()
        thread.join()
    tokens = [t for m in slow_messages for t in m.token_ids]
    assert tokens == list(want.token_ids)
    assert "".join(m.text for m in slow_messages) == want.text
    assert len(slow_messages) < len(tokens)  # several steps in one message
    assert max(len(m.token_ids) for m in slow_messages) > 1
    fast_tokens = sum(len(m.token_ids) for m in fast_messages)
    assert fast_tokens == 20 and len(fast_messages) >= fast_tokens  # one per step, + final


def test_a_dead_engine_core_ends_every_rpc_and_the_server() -> None:
    """SIGKILL the core mid-stream: the open stream ends with UNAVAILABLE (it does not hang),
    a new call is refused with UNAVAILABLE or cannot connect, and the server exits 3."""
    server = start_server("--log-format", "json")
    try:
        core = core_of(server.proc.pid)
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            call = stub.StreamGenerate(
                to_stream(chat_request("Tell a long story.", max_tokens=400)), timeout=60
            )
            next(call)
            health = health_pb2_grpc.HealthStub(channel)
            os.kill(core, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 10
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            except grpc.RpcError as exc:
                # The server is going away: refused (UNAVAILABLE), or caught by its shutdown
                # while in flight (grpc-core ends such calls CANCELLED).
                # Never SERVING, never a hang.
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert server.wait(30) == 3
    finally:
        server.stop()


async def test_under_load_each_message_carries_several_steps() -> None:
    """Above ROWS_PER_TICK streams in a tick, a stream is woken every few ticks: its messages
    carry several tokens (its first one alone, at once), and nothing is lost or reordered: each
    stream gets what the same request gets alone."""
    n, tokens = 3 * ROWS_PER_TICK, 24
    flags = ("--load-format", "dummy:tiny-vocab", "--max-batch-size", str(n))
    stopping = pb.StoppingCriteria(max_tokens=tokens, ignore_eos=True)
    requests = [
        pb.GenerateRequest(
            token_ids=pb.TokenIdsInput(ids=[1 + (i * 7 + j) % 500 for j in range(8)]),
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=stopping,
        )
        for i in range(n)
    ]
    with running_server(*flags, "--max-queue-depth", str(n)) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)

            async def stream(request: pb.GenerateRequest) -> list[list[int]]:
                call = stub.StreamGenerate(to_stream(request), timeout=120)
                return [list(m.token_ids) async for m in call]

            streamed = await asyncio.gather(*(stream(r) for r in requests))
            alone = [await stub.Generate(r, timeout=120) for r in requests[:4]]
    for messages, want in zip(streamed, alone):
        assert [t for m in messages for t in m] == list(want.token_ids)
    assert all(sum(map(len, messages)) == tokens for messages in streamed)
    # The first tokens are never held back: most streams' first message is their first token.
    assert sum(len(messages[0]) == 1 for messages in streamed) > n / 2
    sent = sum(len(messages) for messages in streamed)
    # Admission ramps the batch up and finishing rows shrink it: not every tick is past the
    # threshold, but many are (one message a token and the finals' would be above n * tokens).
    assert sent < 0.8 * n * tokens, sent
    assert max(len(m) for messages in streamed for m in messages) > 1
