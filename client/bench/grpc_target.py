"""Runs a plan against an mlxserve server through StreamGenerate."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from functools import partial

import grpc

from client.bench.metrics import LevelResult, RequestRecord
from client.bench.procs import SenderPool
from client.bench.runner import run_plan
from client.bench.workload import Plan, RequestSpec, Workload
from client.client import AsyncGenerationClient, TLSConfig, build_request
from mlxserve.v1 import generation_pb2 as pb

Progress = Callable[[str], None]

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


class _Streamer:
    """Streams requests over its own channels (in this process or a client process)."""

    def __init__(
        self,
        target: str,
        workload: Workload,
        request_timeout: float | None,
        tls: TLSConfig | None,
        token: str | None,
        channels: int,
    ) -> None:
        # Channels with equal arguments share one connection: a local subchannel pool each.
        options = [("grpc.use_local_subchannel_pool", 1)] if channels > 1 else []
        self.clients = [
            AsyncGenerationClient(target, tls=tls, token=token, options=options)
            for _ in range(channels)
        ]
        self.workload = workload
        self.request_timeout = request_timeout

    async def aclose(self) -> None:
        for client in self.clients:
            await client.close()

    async def stream_one(self, index: int, spec: RequestSpec) -> RequestRecord:
        client, workload = self.clients[index], self.workload
        request = build_request(
            chat=[("user", spec.prompt)],
            max_tokens=spec.max_tokens,
            temperature=workload.temperature,
            ignore_eos=workload.ignore_eos,
            cache_prompt=workload.cache_prompt,
        )
        record = RequestRecord(prompt=spec.prompt[:80], max_tokens=spec.max_tokens)
        started = record.start = time.perf_counter()
        last_message_at: float | None = None
        tokens_seen = 0
        final: pb.StreamGenerateResponse | None = None
        try:
            async for message in client.stream(request, timeout=self.request_timeout):
                now = time.perf_counter()
                count = len(message.token_ids)
                if count:
                    if last_message_at is None:
                        record.ttft = now - started
                    else:
                        # A message with several tokens (a stop-string hold-back) shares its gap.
                        record.inter_token.extend([(now - last_message_at) / count] * count)
                    last_message_at = now
                    tokens_seen += count
                if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    final = message
        except grpc.RpcError as err:
            record.error = f"{err.code().name}: {err.details()}"
        record.latency = time.perf_counter() - started
        # The final message's usage is exact; counting streamed tokens is the fallback.
        if final is not None:
            record.completion_tokens = final.usage.completion_tokens
            record.prompt_tokens = final.usage.prompt_tokens
            record.finish_reason = _FINISH.get(final.finish_reason, "unspecified")
            if final.HasField("timing"):
                record.server_ttft = final.timing.time_to_first_token_seconds
                record.server_queue = final.timing.queue_seconds
        else:
            record.completion_tokens = tokens_seen
        return record


class GrpcTarget:
    """Streams every request; TTFT and inter-token gaps from message arrival times. The
    requests are spread over `channels` channels, each its own connection, as several callers
    would open them (a server's front ends share one port: one connection reaches one), and
    over `processes` client processes (client.bench.procs): one process's grpc.aio would cap
    what it can receive."""

    name = "ours"

    def __init__(
        self,
        target: str,
        *,
        request_timeout: float | None = 600.0,
        tls: TLSConfig | None = None,
        token: str | None = None,
        channels: int = 1,
        processes: int = 1,
    ) -> None:
        self.target = target
        self.request_timeout = request_timeout
        self.tls, self.token = tls, token
        self.channels = max(1, channels)
        self.processes = max(1, processes)

    def run(self, plan: Plan, progress: Progress) -> list[LevelResult]:
        return asyncio.run(self._run(plan, progress))

    async def _run(self, plan: Plan, progress: Progress) -> list[LevelResult]:
        factory = partial(
            _Streamer, self.target, plan.workload, self.request_timeout, self.tls, self.token
        )
        if self.processes > 1:
            pool = SenderPool(factory, self.processes, self.channels)
            try:
                await pool.start()
                return await run_plan(self.name, plan, pool.send, progress)
            finally:
                await pool.close()
        streamer = factory(self.channels)
        turn = itertools.count()
        try:

            async def send(spec: RequestSpec) -> RequestRecord:
                return await streamer.stream_one(next(turn) % self.channels, spec)

            return await run_plan(self.name, plan, send, progress)
        finally:
            await streamer.aclose()


def count_tokens_via_rpc(
    target: str,
    timeout: float = 30.0,
    *,
    tls: TLSConfig | None = None,
    token: str | None = None,
) -> Callable[[str], int]:
    """A token counter for prompt padding: our server's Tokenize of a one-turn chat."""
    from client.client import GenerationClient

    client = GenerationClient(target, tls=tls, token=token)

    def count(text: str) -> int:
        return len(client.tokenize(chat=[("user", text)], timeout=timeout).token_ids)

    return count
