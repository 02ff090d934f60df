"""Tracing overhead: aggregate tokens/s with OTLP export on vs off at concurrency C (not a test).

Starts two servers with the same flags, one with tracing off and one exporting every span over
OTLP/gRPC to a receiver in this process, then runs the same closed-loop load against each:
greedy chat requests, `--max-tokens` tokens with ignore_eos, C at a time, `--waves` batches of
C per round. Rounds alternate (off, on, on, off, off, on, ...) so drift on a shared machine
falls on both sides (use an even --rounds: each server then runs first in half of the pairs).
Prints both tokens/s and the ratio on/off, plus the servers' CPU seconds per generated token
(user + system, all threads, from /proc: much less sensitive than wall time to other load on
the machine), and writes JSON to bench/out/. `--control` runs the same with tracing off on both
servers: the spread of that ratio is the noise floor of the measurement. Before the servers
start, `--micro N` times what tracing adds per request in isolation: extract a traceparent, a
SERVER span with the request's attributes and lifecycle events, and its OTLP export to the
receiver (CPU time of this process, receiver included: an upper bound).

    env $(.venv/bin/python -m service.common.blas --env) .venv/bin/python bench/tracing_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from client.bench.server import ServerProcess
from client.bench.workload import DEFAULT_PROMPTS
from client.client import AsyncGenerationClient, build_request

OUT_DIR = Path(__file__).resolve().parent / "out"
OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


class CountingReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP TraceService: counts the spans and span events it receives."""

    def __init__(self) -> None:
        self.spans = 0
        self.events = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        spans = [
            span
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        with self._lock:
            self.spans += len(spans)
            self.events += sum(len(span.events) for span in spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def start_server(flags: list[str], env: dict[str, str], log_path: Path) -> ServerProcess:
    """A ServerProcess started with `env` on top of this process's environment (OTEL_* vars
    of this process are left out, so only `env` decides whether the server traces)."""
    saved = {name: os.environ.pop(name) for name in OTEL_VARS if name in os.environ}
    os.environ.update(env)
    try:
        server = ServerProcess(flags, log_path=log_path, ready_timeout=300.0)
        server.start()
        return server
    finally:
        for name in env:
            os.environ.pop(name, None)
        os.environ.update(saved)


def micro_cost_us(requests: int, otlp_port: int, prefill_chunks: int = 1) -> float:
    """CPU microseconds per request of the tracing work alone (see the module doc)."""
    from opentelemetry import context, propagate, trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{otlp_port}", insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("micro")
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    started = time.process_time()
    for i in range(requests):
        token = context.attach(propagate.extract({"traceparent": traceparent}))
        try:
            with tracer.start_as_current_span(
                "mlxserve.v1.GenerationService/StreamGenerate", kind=trace.SpanKind.SERVER
            ) as span:
                span.set_attributes(
                    {
                        "mlxserve.request_id": f"r{i}",
                        "mlxserve.prompt_tokens": 40,
                        "mlxserve.max_tokens": 48,
                        "mlxserve.priority": 0,
                    }
                )
                span.add_event("queued", {"queue_depth": 3})
                span.add_event("admitted", {})
                for chunk in range(prefill_chunks):
                    span.add_event("prefill_chunk", {"tokens": 40, "context": 40 * (chunk + 1)})
                span.add_event("first_token", {})
                span.add_event(
                    "finished",
                    {"finish_reason": "length", "prompt_tokens": 40, "completion_tokens": 48},
                )
                span.set_attributes({"mlxserve.finish_reason": "length"})
        finally:
            context.detach(token)
    provider.force_flush()
    cpu = time.process_time() - started
    provider.shutdown()
    return 1e6 * cpu / requests


def cpu_seconds(server: ServerProcess) -> float | None:
    """CPU time (user + system, all threads) the server process has used so far (Linux)."""
    proc = server._proc
    if proc is None:
        return None
    try:
        with open(f"/proc/{proc.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(client: AsyncGenerationClient, prompt: str, max_tokens: int) -> int:
    request = build_request(
        chat=[("user", prompt)], max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    tokens = 0
    async for message in client.stream(request, timeout=600):
        tokens += len(message.token_ids)
    return tokens


async def run_round(
    target: str, args: argparse.Namespace, round_index: int, waves: int
) -> dict[str, Any]:
    async with AsyncGenerationClient(target) as client:
        tokens = 0
        started = time.perf_counter()
        for wave in range(waves):
            base = (round_index * waves + wave) * args.concurrency
            prompts = [
                DEFAULT_PROMPTS[(base + i) % len(DEFAULT_PROMPTS)] for i in range(args.concurrency)
            ]
            done = await asyncio.gather(*(one_request(client, p, args.max_tokens) for p in prompts))
            tokens += sum(done)
        wall = time.perf_counter() - started
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", "-C", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per server (even)")
    parser.add_argument("--waves", type=int, default=2, help="batches of C requests per round")
    parser.add_argument("--server-args", default="", help="extra server flags (both servers)")
    parser.add_argument(
        "--micro", type=int, default=2000, help="requests of the isolated cost (0 = skip)"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="A/A run: the second server traces nothing either (measures the noise floor)",
    )
    args = parser.parse_args()

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    flags = ["--max-batch-size", str(args.concurrency), *args.server_args.split()]

    receiver = CountingReceiver()
    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    otlp_port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()

    micro_us = micro_cost_us(args.micro, otlp_port) if args.micro else None
    if micro_us is not None:
        print(f"tracing work per request in isolation: {micro_us:.0f} us CPU", flush=True)
        receiver.spans = receiver.events = 0  # count the server's spans only
    servers: dict[str, ServerProcess] = {}
    try:
        servers["off"] = start_server(
            flags, {"OTEL_TRACES_EXPORTER": "none"}, OUT_DIR / f"tracing-{stamp}-off.log"
        )
        on_env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        }
        if args.control:
            on_env = {"OTEL_TRACES_EXPORTER": "none"}
        servers["on"] = start_server(flags, on_env, OUT_DIR / f"tracing-{stamp}-on.log")
        # Warm-up (first forwards pay one-off costs), then alternating rounds: off on on off ...
        for name, server in servers.items():
            asyncio.run(run_round(server.target, args, 0, waves=1))
            print(f"warm-up {name} done", flush=True)
        order = [("off", "on") if r % 2 == 0 else ("on", "off") for r in range(args.rounds)]
        rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for r, pair in enumerate(order):
            for name in pair:
                cpu_before = cpu_seconds(servers[name])
                result = asyncio.run(run_round(servers[name].target, args, r + 1, args.waves))
                cpu_after = cpu_seconds(servers[name])
                if cpu_before is not None and cpu_after is not None:
                    result["server_cpu_s"] = cpu_after - cpu_before
                rounds[name].append(result)
                cpu = result.get("server_cpu_s")
                print(
                    f"round {r + 1} tracing {name:>3}: {result['tokens']} tokens in "
                    f"{result['seconds']:.1f}s = {result['tokens_per_s']:.1f} tok/s"
                    + (f", server CPU {1000 * cpu / result['tokens']:.1f} ms/token" if cpu else ""),
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
        collector.stop(1)

    def aggregate(name: str) -> float:
        return sum(r["tokens"] for r in rounds[name]) / sum(r["seconds"] for r in rounds[name])

    def cpu_ms_per_token(name: str) -> float | None:
        if any("server_cpu_s" not in r for r in rounds[name]):
            return None
        return (
            1000
            * sum(r["server_cpu_s"] for r in rounds[name])
            / sum(r["tokens"] for r in rounds[name])
        )

    off, on = aggregate("off"), aggregate("on")
    cpu_off, cpu_on = cpu_ms_per_token("off"), cpu_ms_per_token("on")
    tokens_per_request = statistics.mean(
        r["tokens"] / (args.concurrency * args.waves) for r in rounds["off"]
    )
    per_round = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(rounds["off"], rounds["on"])]
    summary = {
        "control": args.control,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "waves": args.waves,
        "server_flags": flags,
        "tokens_per_s_off": off,
        "tokens_per_s_on": on,
        "ratio_on_over_off": on / off,
        "ratio_per_round": per_round,
        "ratio_median": statistics.median(per_round),
        "server_cpu_ms_per_token_off": cpu_off,
        "server_cpu_ms_per_token_on": cpu_on,
        "cpu_ratio_on_over_off": cpu_on / cpu_off if cpu_on and cpu_off else None,
        "micro_tracing_us_per_request": micro_us,
        "micro_share_of_request_cpu": (
            micro_us / (1000 * cpu_off * tokens_per_request) if micro_us and cpu_off else None
        ),
        "spans_received": receiver.spans,
        "span_events_received": receiver.events,
        "rounds_detail": rounds,
    }
    path = OUT_DIR / f"tracing_overhead-{stamp}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(
        f"{'CONTROL (A/A, both off) ' if args.control else ''}"
        f"C={args.concurrency} max_tokens={args.max_tokens}: tracing off {off:.1f} tok/s, "
        f"on {on:.1f} tok/s, ratio on/off {on / off:.3f} "
        f"(per round {', '.join(f'{x:.3f}' for x in per_round)}); "
        f"receiver got {receiver.spans} spans, {receiver.events} events"
    )
    if cpu_on and cpu_off:
        print(
            f"server CPU per token: off {cpu_off:.1f} ms, on {cpu_on:.1f} ms, "
            f"ratio on/off {cpu_on / cpu_off:.3f}"
        )
        if micro_us:
            share = summary["micro_share_of_request_cpu"]
            print(
                f"isolated tracing work: {micro_us:.0f} us per request = {100 * share:.3f}% "
                f"of a request's server CPU ({tokens_per_request:.0f} tokens x {cpu_off:.1f} ms)"
            )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
