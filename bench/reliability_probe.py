"""Black-box probes of a running server (before/after figures of the reliability work).

    python bench/reliability_probe.py --target 127.0.0.1:50051 undecodable
    python bench/reliability_probe.py --target ... reuse
    python bench/reliability_probe.py --target ... oversized [--chars 4200000]
    python bench/reliability_probe.py --target ... soak --pid PID [--requests 316]
    python bench/reliability_probe.py --target ... keepalive [--seconds 45]
    python bench/reliability_probe.py --target ... drain --pid LAUNCHER_PID

`undecodable` sends bytes that do not parse to every GenerationService RPC and prints the
status codes; `reuse` cancels a stream and at once reuses its request_id, then watches
CacheStats; `oversized` sends a huge `text` (Generate and Tokenize) while a stream decodes and
health is polled, and prints the worst gap of each; `soak` sends short distinct requests and
prints the server's RSS and the pool's reserved bytes; `keepalive` keeps idle connections that
ping every 10 s and every 2 s and prints when the server sends each GOAWAY; `drain` sends SIGTERM
to the server while streams decode (some short enough to finish within a 30 s drain, one not)
and prints what health, a new call and each stream see, and when the process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.errors import error_details
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc

SERVICE = "/mlxserve.v1.GenerationService/"
RPCS = ("Generate", "StreamGenerate", "CacheStats", "GetModelInfo", "Tokenize")
# Field 1 is request_id (a string) in the generation requests; 0xff is not UTF-8.
BAD_PAYLOADS = {
    "truncated varint": b"\x08\xff",
    "bad wire type": b"\x0f\x01",
    "invalid utf-8 in field 1": b"\x0a\x02\xff\xfe",
}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def undecodable(channel: grpc.aio.Channel) -> None:
    for rpc in RPCS:
        for name, payload in BAD_PAYLOADS.items():
            if rpc == "StreamGenerate":
                call = channel.unary_stream(SERVICE + rpc)(payload, timeout=10)
                try:
                    async for _ in call:
                        pass
                    code, details = grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as exc:
                    code, details = exc.code(), exc.details()
            else:
                try:
                    await channel.unary_unary(SERVICE + rpc)(payload, timeout=10)
                    code, details = grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as exc:
                    code, details = exc.code(), exc.details()
            print(f"{rpc:15s} {name:26s} {code.name:18s} {details[:90]!r}")


async def reuse(stub: pb_grpc.GenerationServiceStub) -> None:
    def request() -> pb.StreamGenerateRequest:
        return pb.StreamGenerateRequest(
            request_id="reused-id",
            text="Count from one to a thousand:",
            stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True),
        )

    a = stub.StreamGenerate(request())
    await a.read()
    a.cancel()
    b = stub.StreamGenerate(request())
    await b.read()
    await b.read()
    b.cancel()
    for _ in range(6):
        await asyncio.sleep(1.0)
        stats = await stub.CacheStats(pb.CacheStatsRequest())
        slots = [(s.request_id, s.generated_tokens) for s in stats.slots]
        print(f"active={stats.active_sequences} slots={slots}")


async def oversized(channel: grpc.aio.Channel, chars: int) -> None:
    stub = pb_grpc.GenerationServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    stream = stub.StreamGenerate(
        pb.StreamGenerateRequest(
            text="Once upon a time", stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)
        )
    )
    await stream.read()
    gaps = {"stream": 0.0, "health": 0.0}
    done = asyncio.Event()

    async def follow_stream() -> None:
        last = time.monotonic()
        while not done.is_set():
            if await stream.read() == grpc.aio.EOF:
                return
            now = time.monotonic()
            gaps["stream"] = max(gaps["stream"], now - last)
            last = now

    async def poll_health() -> None:
        while not done.is_set():
            started = time.monotonic()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            gaps["health"] = max(gaps["health"], time.monotonic() - started)
            await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(follow_stream()), asyncio.create_task(poll_health())]
    await asyncio.sleep(1.0)
    gaps["stream"] = gaps["health"] = 0.0
    await asyncio.sleep(2.0)
    print(
        f"baseline (no big request, 2 s): worst stream gap {gaps['stream'] * 1000:.0f} ms, "
        f"worst health check {gaps['health'] * 1000:.0f} ms"
    )
    text = "word " * (chars // 5)
    for rpc, call in (
        ("Generate", lambda: stub.Generate(pb.GenerateRequest(text=text), timeout=120)),
        ("Tokenize", lambda: stub.Tokenize(pb.TokenizeRequest(text=text), timeout=120)),
    ):
        gaps["stream"] = gaps["health"] = 0.0
        started = time.monotonic()
        try:
            answer = await call()
            outcome = f"OK ({len(getattr(answer, 'token_ids', []))} token ids)"
        except grpc.aio.AioRpcError as exc:
            outcome = f"{exc.code().name} {exc.details()[:80]!r}"
        took = time.monotonic() - started
        await asyncio.sleep(0.5)
        print(
            f"{rpc}: {len(text)} chars -> {outcome} in {took * 1000:.0f} ms; worst stream gap "
            f"{gaps['stream'] * 1000:.0f} ms, worst health check {gaps['health'] * 1000:.0f} ms"
        )
    done.set()
    stream.cancel()
    for task in tasks:
        task.cancel()


async def soak(stub: pb_grpc.GenerationServiceStub, pid: int, requests: int, conc: int) -> None:
    async def one(i: int) -> None:
        await stub.Generate(
            pb.GenerateRequest(
                chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=f"Fact {i}?")]),
                stopping=pb.StoppingCriteria(max_tokens=8),
            ),
            timeout=300,
        )

    def line(done: int, stats: pb.CacheStatsResponse) -> str:
        return json.dumps(
            {
                "requests": done,
                "rss_mb": round(rss_mb(pid)),
                "reserved_mib": round(stats.reserved_bytes / 2**20, 1),
                "total_blocks": stats.total_blocks,
                "active_blocks": stats.active_blocks,
                "cached_blocks": stats.cached_blocks,
            }
        )

    await one(-1)  # warm: the first request's buffers are not a leak
    print(line(0, await stub.CacheStats(pb.CacheStatsRequest())))
    started = time.monotonic()
    sem = asyncio.Semaphore(conc)

    async def limited(i: int) -> None:
        async with sem:
            await one(i)

    step = max(1, requests // 8)
    for base in range(0, requests, step):
        await asyncio.gather(*(limited(i) for i in range(base, min(requests, base + step))))
        print(line(min(requests, base + step), await stub.CacheStats(pb.CacheStatsRequest())))
    print(f"{requests} requests in {time.monotonic() - started:.0f} s")


def keepalive(target: str, seconds: float) -> None:
    """Idle connections pinging every 10 s (common client settings) and every 2 s."""
    intervals_ms = (10_000, 2_000)
    started = time.monotonic()
    left_ready: dict[int, list[float]] = {ms: [] for ms in intervals_ms}
    channels = []
    for ms in intervals_ms:
        channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.keepalive_time_ms", ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
            ],
        )
        ready = threading.Event()

        def on_state(state: grpc.ChannelConnectivity, ms: int = ms, ready=ready) -> None:
            if state is grpc.ChannelConnectivity.READY:
                ready.set()
            elif ready.is_set():  # left READY: the server sent GOAWAY
                left_ready[ms].append(round(time.monotonic() - started, 1))

        channel.subscribe(on_state, try_to_connect=True)
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        channels.append(channel)
    time.sleep(seconds)
    for ms in intervals_ms:
        seen = left_ready[ms]
        outcome = f"lost the connection (GOAWAY) at {seen[0]} s" if seen else "kept it"
        print(f"pinging every {ms / 1000:.0f} s, idle for {seconds:.0f} s: {outcome}")
    for channel in channels:
        channel.close()


async def drain(channel: grpc.aio.Channel, pid: int, streams: int, max_tokens: int) -> None:
    """SIGTERM once `streams` short streams and one long one all decode (keep their number
    within the server's batch size, so none waits in the queue)."""
    stub = pb_grpc.GenerationServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    signalled: float | None = None

    def request(tokens: int) -> pb.StreamGenerateRequest:
        return pb.StreamGenerateRequest(
            text="Once upon a time",
            stopping=pb.StoppingCriteria(max_tokens=tokens, ignore_eos=True),
        )

    def since() -> float:
        assert signalled is not None
        return time.monotonic() - signalled

    async def follow(name: str, call, decoding: asyncio.Event) -> str:
        """Reads the stream from its start; counts what arrives after the signal."""
        tokens, final = 0, None
        try:
            while (message := await call.read()) != grpc.aio.EOF:
                decoding.set()
                if signalled is not None:
                    tokens += len(message.token_ids)
                if message.finish_reason:
                    final = pb.FinishReason.Name(message.finish_reason)
            status = "OK"
        except grpc.aio.AioRpcError as exc:
            status = f"{exc.code().name} {exc.details()[:60]!r}"
        decoding.set()
        return (
            f"{name}: {tokens} tokens after the signal, final message {final or 'none'}, "
            f"{status}, ended at {since():.1f} s"
        )

    names = [f"stream {i} (max_tokens {max_tokens})" for i in range(streams)] + ["long stream"]
    sizes = [max_tokens] * streams + [100_000]
    decoding = [asyncio.Event() for _ in names]
    followers = [
        asyncio.create_task(follow(name, stub.StreamGenerate(request(size)), event))
        for name, size, event in zip(names, sizes, decoding, strict=True)
    ]
    for event in decoding:
        await event.wait()
    signalled = time.monotonic()
    os.kill(pid, signal.SIGTERM)

    async def watch_health() -> str:
        while since() < 60:
            try:
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if answer.status != health_pb2.HealthCheckResponse.SERVING:
                    name = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
                    return f"health: {name} at {since():.2f} s"
            except grpc.aio.AioRpcError as exc:
                return f"health: {exc.code().name} at {since():.2f} s"
            await asyncio.sleep(0.05)
        return "health: SERVING for 60 s"

    async def new_call() -> str:
        await asyncio.sleep(1.0)
        try:
            await stub.Generate(pb.GenerateRequest(text="Hello"), timeout=30)
            return f"a new call at 1 s: OK at {since():.1f} s"
        except grpc.aio.AioRpcError as exc:
            info = error_details(exc)
            retry = "no RetryInfo" if info.retry_delay is None else f"retry in {info.retry_delay} s"
            said = f"reason {info.reason}, {retry}" if info.reason else retry
            return f"a new call at 1 s: {exc.code().name} ({said}) at {since():.1f} s"

    async def process_gone() -> str:
        while Path(f"/proc/{pid}").exists() and since() < 120:
            await asyncio.sleep(0.1)
        return f"process gone at {since():.1f} s"

    lines = await asyncio.gather(watch_health(), new_call(), *followers, process_gone())
    print("\n".join(lines))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="127.0.0.1:50051")
    sub = parser.add_subparsers(dest="probe", required=True)
    sub.add_parser("undecodable")
    sub.add_parser("reuse")
    big = sub.add_parser("oversized")
    big.add_argument("--chars", type=int, default=4_200_000)
    s = sub.add_parser("soak")
    s.add_argument("--pid", type=int, required=True)
    s.add_argument("--requests", type=int, default=316)
    s.add_argument("--concurrency", type=int, default=8)
    k = sub.add_parser("keepalive")
    k.add_argument("--seconds", type=float, default=45.0)
    d = sub.add_parser("drain")
    d.add_argument("--pid", type=int, required=True, help="the server's (launcher's) pid")
    d.add_argument("--streams", type=int, default=3)
    d.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    if args.probe == "keepalive":
        keepalive(args.target, args.seconds)
        return
    options = [("grpc.max_send_message_length", 128 << 20)]
    async with grpc.aio.insecure_channel(args.target, options=options) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        if args.probe == "undecodable":
            await undecodable(channel)
        elif args.probe == "reuse":
            await reuse(stub)
        elif args.probe == "oversized":
            await oversized(channel, args.chars)
        elif args.probe == "drain":
            await drain(channel, args.pid, args.streams, args.max_tokens)
        else:
            await soak(stub, args.pid, args.requests, args.concurrency)


if __name__ == "__main__":
    asyncio.run(main())
