"""Client processes for the gRPC target: the plan's requests are sent from several processes.

One Python process receiving streamed tokens spends tens of microseconds of its one core per
message in grpc.aio, so at a few tens of thousands of tokens/s the harness itself would be what
is measured. Many callers of a real service are many processes; `SenderPool` spreads the
requests over `processes` children, each with its own event loop and channels. The parent keeps
the plan's timing (burst rounds, closed loop, arrivals) and hands each request to a child in
turn; the child streams it and sends back the finished `RequestRecord` (one message per request,
not per token). Records carry `time.perf_counter()` times, which on Linux read one system-wide
monotonic clock, so the children's times and the parent's level start compare.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from client.bench.metrics import RequestRecord
from client.bench.workload import RequestSpec

# Streams one request on the given channel index; never raises (record.error instead).
StreamOne = Callable[[int, RequestSpec], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class ChildConfig:
    """What a child needs to build its own channels and stream requests (picklable)."""

    factory: Callable[[int], Any]  # channels -> an object with `stream_one` and `aclose`
    channels: int


def _child_main(config: ChildConfig, pipe: Connection) -> None:
    asyncio.run(_child_loop(config, pipe))


async def _child_loop(config: ChildConfig, pipe: Connection) -> None:
    sender = config.factory(config.channels)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    async def one(key: int, spec: RequestSpec) -> None:
        record = await sender.stream_one(key % config.channels, spec)
        pipe.send((key, record))

    def readable() -> None:
        try:
            message = pipe.recv()
        except EOFError:
            message = None
        if message is None:
            loop.remove_reader(pipe.fileno())
            done.set()
            return
        key, spec = message
        task = loop.create_task(one(key, spec))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_reader(pipe.fileno(), readable)
    pipe.send("ready")
    await done.wait()
    if tasks:
        await asyncio.gather(*tasks)
    await sender.aclose()


class SenderPool:
    """`processes` children streaming the requests; `send` is the runner's Send."""

    def __init__(self, factory: Callable[[int], Any], processes: int, channels: int) -> None:
        ctx = mp.get_context("spawn")  # grpc does not survive fork with live channels
        self._pipes: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        for index in range(processes):
            share = channels // processes + (1 if index < channels % processes else 0)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_child_main, args=(ChildConfig(factory, max(1, share)), theirs), daemon=True
            )
            proc.start()
            theirs.close()
            self._pipes.append(ours)
            self._procs.append(proc)
        # Per child: key -> the future its record resolves.
        self._pending: list[dict[int, asyncio.Future[RequestRecord]]] = [{} for _ in self._pipes]
        self._keys = itertools.count()
        self._turn = itertools.cycle(range(processes))

    async def start(self, timeout: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        for pipe in self._pipes:
            if not await loop.run_in_executor(None, pipe.poll, timeout):
                raise RuntimeError(f"a client process did not start within {timeout:g}s")
            if pipe.recv() != "ready":
                raise RuntimeError("a client process sent something other than ready")
        for index, pipe in enumerate(self._pipes):
            loop.add_reader(pipe.fileno(), self._readable, index)

    def _readable(self, index: int) -> None:
        pipe, pending = self._pipes[index], self._pending[index]
        try:
            key, record = pipe.recv()
        except EOFError:  # the child died: fail the requests it held
            asyncio.get_running_loop().remove_reader(pipe.fileno())
            for future in pending.values():
                if not future.done():
                    future.set_exception(RuntimeError("a client process exited"))
            pending.clear()
            return
        future = pending.pop(key, None)
        if future is not None and not future.done():
            future.set_result(record)

    async def send(self, spec: RequestSpec) -> RequestRecord:
        key, index = next(self._keys), next(self._turn)
        future = asyncio.get_running_loop().create_future()
        self._pending[index][key] = future
        self._pipes[index].send((key, spec))
        return await future

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for pipe in self._pipes:
            try:
                loop.remove_reader(pipe.fileno())
                pipe.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            await loop.run_in_executor(None, proc.join, 30)
            if proc.is_alive():
                proc.kill()
        for pipe in self._pipes:
            pipe.close()
