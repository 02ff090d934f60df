"""The front end's side of the engine core: requests in, per-step outputs out (service.protocol).

One `EngineClient` per front-end process, on its event loop. It sends requests, aborts and
stats queries on a DEALER socket, and reads the core's per-step `Outputs` from its own PULL
socket, handing each request's outputs to that request's queue (several steps' outputs pile
up there when a consumer is slow; the servicer then sends them as one message).

If the core dies, every open request gets `CORE_GONE` and `gone` is set: nothing waits on a
process that is not there.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

from mlxserve.v1 import generation_pb2 as pb
from service import protocol
from service.protocol import GenerationRequest

log = structlog.get_logger(__name__)
CORE_GONE = object()  # put in a request's queue when the engine core has died


class LoadFailedError(RuntimeError):
    """The engine core could not load the model (the message says why)."""


class EngineClient:
    def __init__(self, run_dir: Path, index: int) -> None:
        self.name = f"fe{index}"
        self._run_dir = run_dir
        self._index = index
        self._context = zmq.asyncio.Context()
        self._dealer: Any = None
        self._pull: Any = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._stats: dict[int, asyncio.Future[pb.CacheStatsResponse]] = {}
        self._ids = itertools.count()
        self._ready: asyncio.Future[protocol.Ready] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.gone = asyncio.Event()
        self.on_health: Callable[[bool], None] | None = None

    async def connect(self) -> protocol.Ready:
        """Register with the core and wait until its model is loaded; raises
        LoadFailedError when it cannot be."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        address = protocol.frontend_address(self._run_dir, self._index)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(address)
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(protocol.core_address(self._run_dir))
        self._tasks = [
            asyncio.ensure_future(self._read_replies()),
            asyncio.ensure_future(self._read_outputs()),
        ]
        await self._send(protocol.Hello(self.name, address))
        return await self._ready

    def submit(
        self, request: GenerationRequest, trace: tuple[str, str] | None = None
    ) -> tuple[str, asyncio.Queue[Any]]:
        """Queue a request in the core; its outputs (StepOutput), or an protocol.Rejected, or
        CORE_GONE, arrive in the returned queue. `trace`: the RPC span's ids, for the core's
        log lines about the request."""
        rid = f"{self.name}-{next(self._ids)}"
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = outputs
        if self.gone.is_set():
            outputs.put_nowait(CORE_GONE)
        else:
            self._send_now(protocol.Add(rid, request, trace))
        return rid, outputs

    def abort(self, rid: str) -> None:
        """The request ended here (client gone, stop string): end it in the core. Its final
        output still arrives (and is dropped if nobody waits for it)."""
        if not self.gone.is_set():
            self._send_now(protocol.Abort(rid))

    def release(self, rid: str) -> None:
        self._queues.pop(rid, None)

    async def stats(self, timeout: float = 5.0) -> pb.CacheStatsResponse:
        qid = next(self._ids)
        future: asyncio.Future[pb.CacheStatsResponse] = asyncio.get_running_loop().create_future()
        self._stats[qid] = future
        try:
            await self._send(protocol.StatsQuery(qid))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._stats.pop(qid, None)

    def core_died(self) -> None:
        """The core process is gone: end every open request, refuse new ones."""
        if self.gone.is_set():
            return
        self.gone.set()
        for outputs in self._queues.values():
            outputs.put_nowait(CORE_GONE)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(LoadFailedError("the engine core exited while loading"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for socket in (self._dealer, self._pull):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    # -- sockets -------------------------------------------------------------------------
    async def _send(self, message: Any) -> None:
        await self._dealer.send(protocol.encode(message))

    def _send_now(self, message: Any) -> None:
        # A DEALER queues the message at once (the core reads it within one poll).
        self._dealer.send(protocol.encode(message), zmq.NOBLOCK)

    async def _read_replies(self) -> None:
        while True:
            message = protocol.decode_from_core(await self._dealer.recv())
            if isinstance(message, protocol.Ready):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(message)
            elif isinstance(message, protocol.LoadFailed):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_exception(LoadFailedError(message.message))
            elif isinstance(message, protocol.Rejected):
                outputs = self._queues.get(message.rid)
                if outputs is not None:
                    outputs.put_nowait(message)
            elif isinstance(message, protocol.StatsReply):
                future = self._stats.get(message.qid)
                if future is not None and not future.done():
                    future.set_result(pb.CacheStatsResponse.FromString(message.stats))
            elif isinstance(message, protocol.Health) and self.on_health is not None:
                self.on_health(message.healthy)

    async def _read_outputs(self) -> None:
        while True:
            batch = protocol.decode_outputs(await self._pull.recv(copy=False))
            for out in batch.items:
                outputs = self._queues.get(out.rid)
                if outputs is not None:
                    outputs.put_nowait(out)


def drain(outputs: asyncio.Queue[Any]) -> list[Any]:
    """Everything already waiting in a request's queue (after one awaited item)."""
    items = []
    while True:
        try:
            items.append(outputs.get_nowait())
        except asyncio.QueueEmpty:
            return items
