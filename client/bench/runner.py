"""Drives a plan's load pattern against any streaming target (gRPC, HTTP) on one asyncio loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from client.bench.metrics import LevelResult, RequestRecord
from client.bench.workload import LevelPlan, Plan, RequestSpec

Progress = Callable[[str], None]
# Sends one request and measures it; never raises for a failed request (record.error instead).
Send = Callable[[RequestSpec], Awaitable[RequestRecord]]


def _describe(records: list[RequestRecord], wall: float) -> str:
    tokens = sum(r.completion_tokens for r in records)
    errors = [r.error for r in records if r.error]
    text = f"{len(records)} requests, {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s"
    if errors:
        text += f", {len(errors)} errors (first: {errors[0]})"
    return text


async def _gather_timed(send: Send, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
    started = time.perf_counter()
    records = await asyncio.gather(*(send(spec) for spec in specs))
    return list(records), time.perf_counter() - started


async def _closed_loop(
    send: Send, specs: list[RequestSpec], concurrency: int
) -> tuple[list[RequestRecord], float]:
    """C workers; each sends its next request when its previous one ends."""
    queue = list(reversed(specs))
    records: list[RequestRecord] = []
    started = time.perf_counter()

    async def worker() -> None:
        while queue:
            spec = queue.pop()
            records.append(await send(spec))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
    return records, time.perf_counter() - started


async def _open_loop(send: Send, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
    """Each request at its planned time, whatever the earlier ones are doing."""
    started = time.perf_counter()
    tasks = []
    for spec in specs:
        delay = started + spec.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(spec)))
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - started


async def run_level(name: str, level: LevelPlan, send: Send, progress: Progress) -> LevelResult:
    for index, batch in enumerate(level.warmup):
        records, wall = await _gather_timed(send, batch)
        progress(
            f"{name} {level.label} warm-up {index + 1}/{len(level.warmup)}: "
            f"{_describe(records, wall)}"
        )
    result = LevelResult(target=name, concurrency=level.concurrency, rate=level.rate)
    for index, batch in enumerate(level.batches):
        level_start = time.perf_counter()
        if level.arrival == "burst":
            records, wall = await _gather_timed(send, batch)
        elif level.arrival == "closed":
            records, wall = await _closed_loop(send, batch, level.concurrency or 1)
        else:
            records, wall = await _open_loop(send, batch)
        for record in records:  # send times: absolute perf_counter -> relative to the level
            record.start -= level_start
        result.wall_seconds += wall
        result.requests.extend(records)
        part = f" round {index + 1}/{len(level.batches)}" if len(level.batches) > 1 else ""
        progress(f"{name} {level.label}{part}: {_describe(records, wall)}")
    return result


async def run_plan(name: str, plan: Plan, send: Send, progress: Progress) -> list[LevelResult]:
    if plan.warmup:
        for spec in plan.warmup:  # one at a time: the first forwards pay one-off setup costs
            record = await send(spec)
            progress(
                f"{name} warm-up: {record.completion_tokens} tokens in {record.latency:.2f}s"
                + (f" (failed: {record.error})" if record.error else "")
            )
    return [await run_level(name, level, send, progress) for level in plan.levels]
