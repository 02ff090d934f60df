"""Runs a workload against an mlxserve server through StreamGenerate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from client.bench.metrics import LevelResult, RequestRecord
from client.bench.workload import Workload
from client.client import AsyncGenerationClient, build_request
from mlxserve.v1 import generation_pb2 as pb

Progress = Callable[[str], None]


class GrpcTarget:
    """Closed-loop sweep: a warm-up request, then per level rounds of C requests at once."""

    name = "ours"

    def __init__(self, target: str, *, request_timeout: float | None = 600.0) -> None:
        self.target = target
        self.request_timeout = request_timeout

    def run(self, workload: Workload, progress: Progress) -> list[LevelResult]:
        return asyncio.run(self._run(workload, progress))

    async def _run(self, workload: Workload, progress: Progress) -> list[LevelResult]:
        async with AsyncGenerationClient(self.target) as client:
            # One warm-up request first: the first forward pays one-off setup costs.
            warm = await self._one_request(client, workload, workload.prompts[0])
            progress(
                f"ours warm-up: {warm.completion_tokens} tokens in {warm.latency:.1f}s"
                + (f" (failed: {warm.error})" if warm.error else "")
            )
            return [
                await self._run_level(client, workload, concurrency, progress)
                for concurrency in workload.concurrency
            ]

    async def _run_level(
        self,
        client: AsyncGenerationClient,
        workload: Workload,
        concurrency: int,
        progress: Progress,
    ) -> LevelResult:
        level = LevelResult(target=self.name, concurrency=concurrency)
        for round_index in range(workload.rounds):
            prompts = workload.prompts_for(concurrency, round_index)
            started = time.perf_counter()
            records = await asyncio.gather(
                *(self._one_request(client, workload, prompt) for prompt in prompts)
            )
            wall = time.perf_counter() - started
            level.wall_seconds += wall
            level.requests.extend(records)
            tokens = sum(r.completion_tokens for r in records)
            errors = [r.error for r in records if r.error]
            progress(
                f"ours C={concurrency} round {round_index + 1}/{workload.rounds}: "
                f"{tokens} tokens in {wall:.1f}s = {tokens / wall:.1f} tok/s"
                + (f", {len(errors)} errors (first: {errors[0]})" if errors else "")
            )
        return level

    async def _one_request(
        self, client: AsyncGenerationClient, workload: Workload, prompt: str
    ) -> RequestRecord:
        request = build_request(
            chat=[("user", prompt)],
            max_tokens=workload.max_tokens,
            temperature=workload.temperature,
            ignore_eos=workload.ignore_eos,
            cache_prompt=workload.cache_prompt,
        )
        record = RequestRecord(prompt=prompt)
        started = time.perf_counter()
        last_message_at: float | None = None
        tokens_seen = 0
        final_usage: pb.Usage | None = None
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
                    final_usage = message.usage
        except grpc.RpcError as err:
            record.error = f"{err.code().name}: {err.details()}"
        record.latency = time.perf_counter() - started
        # The final message's usage is exact; counting messages is the fallback.
        record.completion_tokens = (
            final_usage.completion_tokens if final_usage is not None else tokens_seen
        )
        return record
