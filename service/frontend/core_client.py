"""The front end's side of the engine core: requests in, per-tick outputs out (service.protocol).

One `CoreClient` per front-end process, on its event loop, holds the process's only table of
running requests (`RequestStream`s by their handle). It sends requests, aborts and stats queries
on a DEALER socket, and reads the core's per-tick `Outputs` from its own PULL socket: every
message already waiting is read, pushed into the streams, and then each stream that got
something is woken once. A stop string matched while pushing is aborted in the core at once.

Under load a stream is woken every few ticks, not every tick, so that its RPC sends several
tokens a message: a message costs the front end (and the caller) the same CPU whatever it
carries, and with hundreds of streams that cost, paid per token, is what limits the process.
Up to `ROWS_PER_TICK` streams with tokens in a tick, each is woken every tick (one message per
step); above, every k-th tick, k = ceil(streams / ROWS_PER_TICK) up to `MAX_TICKS_PER_WAKE`,
staggered by stream so that each tick wakes about the same number. A stream's first tokens and
its end are never held back, and held tokens go out after `MAX_HOLD_S` when no tick comes.

If the core dies, every open request fails with CORE_GONE and `gone` is set: nothing waits on a
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

from service import protocol
from service.common.tokenizer import Tokenizer
from service.frontend.stream import Failure, RequestStream, push_outputs
from service.protocol import GenerationRequest

log = structlog.get_logger(__name__)

ROWS_PER_TICK = 32  # streams woken every tick before their messages start to carry more
MAX_TICKS_PER_WAKE = 8
MAX_HOLD_S = 0.05  # held tokens go out after this when no tick comes (a paused core)
RESEND_S = 0.005  # retry of a send the core's full queue refused


class LoadFailedError(RuntimeError):
    """The engine core could not load the model (the message says why)."""


class CoreClient:
    def __init__(self, run_dir: Path, index: int) -> None:
        self.name = f"fe{index}"
        self._run_dir = run_dir
        self._index = index
        self._context = zmq.asyncio.Context()
        self._dealer: Any = None
        self._pull: Any = None
        self._streams: dict[int, RequestStream] = {}  # by rid, while their RPC runs
        self._request_ids: set[str] = set()  # the callers' ids of those requests
        self._stats: dict[int, asyncio.Future[protocol.CacheCounters]] = {}
        self._adapter_replies: dict[int, asyncio.Future[protocol.AdapterReply]] = {}
        self._ids = itertools.count()
        self._outbox: list[protocol.ToCore] = []  # sent when the loop iteration ends (_flush)
        self._ticks = 0  # reads of the output socket, for the staggered wakes
        self._held: dict[int, RequestStream] = {}  # streams with tokens not woken for yet
        self._ready: asyncio.Future[protocol.Ready] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.gone = asyncio.Event()
        self.idle = asyncio.Event()  # set whenever no request is open
        self.idle.set()
        self.on_health: Callable[[bool], None] | None = None
        # Told the adapters requests may use, whenever a load or unload changed them.
        self.on_adapters: Callable[[list[protocol.AdapterDescription]], None] | None = None
        # Told where the core saved the model's tokenizer, before Ready (perhaps twice).
        self.on_tokenizer_saved: Callable[[str], None] | None = None

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
        self._send_now(protocol.Hello(self.name, address))
        return await self._ready

    # -- requests ----------------------------------------------------------------------
    def running(self, request_id: str) -> bool:
        return request_id in self._request_ids

    def submit(
        self,
        request: GenerationRequest,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        trace: tuple[str, str] | None = None,
    ) -> RequestStream:
        """Queue a request in the core; its outputs arrive in the returned stream until
        `close`. `trace`: the RPC span's ids, for the core's log lines about the request."""
        stream = RequestStream(request, tokenizer, eos_token_ids, rid=next(self._ids))
        self._streams[stream.rid] = stream
        self._request_ids.add(request.request_id)
        self.idle.clear()
        if self.gone.is_set():
            stream.fail(Failure.CORE_GONE)
        else:
            self._send_now(protocol.Add(stream.rid, request, trace))
        return stream

    def close(self, stream: RequestStream) -> None:
        """The RPC is over. A request that has not ended (its client left, the deadline
        passed) is aborted in the core, which frees its slot."""
        if self._streams.pop(stream.rid, None) is None:
            return
        self._held.pop(stream.rid, None)
        self._request_ids.discard(stream.request.request_id)
        if not stream.ended:
            self._abort(stream.rid)
        if not self._streams:
            self.idle.set()

    def end_all(self) -> None:
        """The drain timeout passed: every open request ends now, as cancelled."""
        for stream in self._streams.values():
            if not stream.ended:
                stream.end()
                self._abort(stream.rid)

    async def stats(self, timeout: float = 5.0) -> protocol.CacheCounters:
        qid = next(self._ids)
        future: asyncio.Future[protocol.CacheCounters] = asyncio.get_running_loop().create_future()
        self._stats[qid] = future
        try:
            self._send_now(protocol.StatsQuery(qid))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._stats.pop(qid, None)

    async def load_adapter(self, name: str, path: str) -> protocol.AdapterReply:
        return await self._adapter_command(lambda qid: protocol.LoadAdapter(qid, name, path))

    async def unload_adapter(self, name: str) -> protocol.AdapterReply:
        return await self._adapter_command(lambda qid: protocol.UnloadAdapter(qid, name))

    async def _adapter_command(self, make: Callable[[int], Any]) -> protocol.AdapterReply:
        """Send a load or unload and wait for the core's reply (a load reads the adapter's
        files between two engine steps: no timeout of our own, the RPC's deadline applies)."""
        qid = next(self._ids)
        future: asyncio.Future[protocol.AdapterReply] = asyncio.get_running_loop().create_future()
        self._adapter_replies[qid] = future
        try:
            self._send_now(make(qid))
            return await future
        finally:
            self._adapter_replies.pop(qid, None)

    def core_died(self) -> None:
        """The core process is gone: end every open request, refuse new ones."""
        if self.gone.is_set():
            return
        self.gone.set()
        for stream in self._streams.values():
            stream.fail(Failure.CORE_GONE)
        for future in self._adapter_replies.values():
            if not future.done():
                future.set_exception(ConnectionError("the engine core exited"))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(LoadFailedError("the engine core exited while loading"))

    async def close_sockets(self) -> None:
        self._flush()
        for task in self._tasks:
            task.cancel()
        for socket in (self._dealer, self._pull):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    # -- sockets -------------------------------------------------------------------------
    def _abort(self, rid: int) -> None:
        if not self.gone.is_set():
            self._send_now(protocol.Abort(rid))

    def _send_now(self, message: Any) -> None:
        """Queue a message for the core. What a loop iteration queues (a burst's requests,
        their aborts) goes out as one ZeroMQ message when the iteration ends: a send, and the
        core's receive, cost more than encoding one more request."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        if not self._outbox or self._dealer is None or self._dealer.closed:
            return
        try:
            # A DEALER queues the message at once (the core reads it within one poll).
            self._dealer.send(protocol.encode_to_core(self._outbox), zmq.NOBLOCK)
        except zmq.Again:  # the core is behind by a queue's worth: nothing is dropped
            asyncio.get_running_loop().call_later(RESEND_S, self._flush)
            return
        self._outbox = []

    async def _read_replies(self) -> None:
        while True:
            message = protocol.decode_from_core(await self._dealer.recv())
            if isinstance(message, protocol.Ready):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(message)
            elif isinstance(message, protocol.TokenizerSaved):
                if self.on_tokenizer_saved is not None:
                    self.on_tokenizer_saved(message.tokenizer_dir)
            elif isinstance(message, protocol.LoadFailed):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_exception(LoadFailedError(message.message))
            elif isinstance(message, protocol.Rejected):
                stream = self._streams.get(message.rid)
                if stream is not None:
                    failure = (
                        Failure.ADAPTER_NOT_FOUND
                        if message.reason == "adapter"
                        else Failure(message.reason)
                    )
                    stream.fail(failure, message.message, message.code)
            elif isinstance(message, protocol.AdapterReply):
                reply = self._adapter_replies.get(message.qid)
                if reply is not None and not reply.done():
                    reply.set_result(message)
            elif isinstance(message, protocol.AdaptersChanged) and self.on_adapters is not None:
                self.on_adapters(message.adapters)
            elif isinstance(message, protocol.StatsReply):
                future = self._stats.get(message.qid)
                if future is not None and not future.done():
                    future.set_result(message.stats)
            elif isinstance(message, protocol.Health) and self.on_health is not None:
                self.on_health(message.healthy)

    async def _read_outputs(self) -> None:
        while True:
            if self._held and not await self._pull.poll(MAX_HOLD_S * 1000, zmq.POLLIN):
                self._wake_held()  # no tick came: what was held goes out now
                continue
            frames = [await self._pull.recv(copy=False)]
            while True:  # every tick already here: one wake-up per stream for all of them
                try:
                    frames.append(await self._pull.recv(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            touched: dict[int, RequestStream] = {}
            for frame in frames:
                out = protocol.decode_outputs(frame)
                for rid in push_outputs(out, self._streams, touched):
                    self._abort(rid)  # a stop string ended it here
            self._wake(touched)

    def _wake(self, touched: dict[int, RequestStream]) -> None:
        """Wake the streams that got something: each one, or under load each in its turn."""
        self._ticks += 1
        every = min(MAX_TICKS_PER_WAKE, -(-len(touched) // ROWS_PER_TICK))
        if every <= 1:
            self._wake_held()
            for stream in touched.values():
                stream.wake()
            return
        tick, held = self._ticks, self._held
        held.update(touched)
        for rid, stream in list(held.items()):
            if (tick + rid) % every == 0 or stream.urgent:
                del held[rid]
                stream.wake()

    def _wake_held(self) -> None:
        for stream in self._held.values():
            stream.wake()
        self._held.clear()
