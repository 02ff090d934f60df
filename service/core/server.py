"""The engine-core process: the only process that imports MLX.

It loads the model and runs the scheduler, the KV cache manager and the model runner on the
loop thread (service.core.runtime, service.core.loop). Its main thread serves the front ends over
ZeroMQ (service.protocol): it registers them and passes their requests, aborts and stats queries
to the loop's inbox; it keeps no per-request state. The loop thread sends each front end one
`Outputs` message per tick (`FrontendSink`), and hands stats replies and health notices back to
the main thread, which wakes at once to send them.

A request with a response format is compiled (cached) on the grammar cache's own thread before
it is queued, so the loop thread never waits on a compile; a format refused here is answered
with `Rejected` (INVALID_ARGUMENT), and a request aborted meanwhile is dropped once compiled.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from service import protocol
from service.common import trace_ids
from service.common.backend import mlx_error
from service.common.config import CoreConfig
from service.common.grammar import GrammarError, format_field
from service.common.logging import configure_logging, exit_now

if TYPE_CHECKING:
    from service.common.tokenizer import Tokenizer
    from service.core.runtime import Runtime
    from service.core.scheduler.request import Request

log = structlog.get_logger(__name__)
POLL_MS = 50  # how often the main thread looks up from its socket when nothing arrives
# A load that fails before front end 0 has said hello waits this long for it: the reason then
# reaches the launcher, which prints it (an adapter refused at once would otherwise exit first).
HELLO_WAIT_S = 10.0


class FrontendSink:
    """Where the requests of one front end deliver their outputs: a PUSH socket to its PULL,
    made and used on the loop thread only (zmq sockets are not thread-safe)."""

    def __init__(self, frontend: str, address: str, context: Any) -> None:
        self.batch_key = frontend
        self._address = address
        self._context = context
        self._socket: Any = None

    def deliver(self, outputs: protocol.Outputs) -> None:
        if self._socket is None:
            self._socket = self._context.socket(zmq.PUSH)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self._address)
        self._socket.send(protocol.encode(outputs), copy=False)

    def close(self) -> None:
        """After the loop thread has ended."""
        if self._socket is not None:
            self._socket.close(linger=0)


class CoreServer:
    def __init__(self, config: CoreConfig, run_dir: Path) -> None:
        from service.core.runtime import Runtime  # MLX: only ever imported in this process

        self.config = config
        self.run_dir = run_dir
        self.runtime: Runtime = Runtime(config, run_dir)
        self.context = zmq.Context()
        self._sinks: dict[str, FrontendSink] = {}
        self._peers: dict[str, bytes] = {}  # front end -> its ROUTER identity
        # Messages for the front ends made on the loop thread, sent from this one.
        self._outgoing: queue.SimpleQueue[tuple[bytes | None, bytes]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._ready_sent = False
        self._failed_at: float | None = None  # when a failed load first had nobody to tell
        self._stopping = threading.Event()
        # Requests whose response format is compiling, by (front end, rid): an abort that
        # comes meanwhile marks them (True) to be dropped once compiled.
        self._compiling: dict[tuple[str, int], bool] = {}
        self._compiling_lock = threading.Lock()
        self.runtime.on_engine_health = lambda ok: self._send_later(None, protocol.Health(ok))
        self.runtime.on_request_finished = forget_trace
        self.runtime.on_request_rejected = self._reject_request
        self.runtime.on_adapters_changed = lambda adapters: self._send_later(
            None, protocol.AdaptersChanged(adapters)
        )
        self.runtime.on_tokenizer = self._save_tokenizer
        self._tokenizer_saved = False  # set on the loop thread once its files are written

    def serve(self) -> int:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(protocol.core_address(self.run_dir))
        self.runtime.start()
        parent = os.getppid()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if os.getppid() != parent:
                    log.error("the server process is gone; the engine core stops")
                    break
                events = dict(poller.poll(POLL_MS))
                if events.get(router):
                    self._receive(router)
                if events.get(self._wake_read):
                    os.read(self._wake_read, 4096)
                self._send_outgoing(router)
                if self._load_failed(router):
                    return 2
                if self._ready_sent and not self.runtime.engine_running:
                    log.error("the loop thread stopped: the engine core exits")
                    return 4
                self._announce(router)
        finally:
            self.runtime.shutdown()  # ends what still runs (their final outputs go out)
            for sink in self._sinks.values():
                sink.close()
            router.close(linger=0)
            self.context.term()
            os.close(self._wake_read)
            os.close(self._wake_write)
        return 0

    def stop(self) -> None:
        self._stopping.set()

    # -- messages ----------------------------------------------------------------------
    def _receive(self, router: Any) -> None:
        while True:
            try:
                peer, data = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for message in protocol.decode_to_core(data):
                self._handle(router, peer, message)

    def _handle(self, router: Any, peer: bytes, message: protocol.ToCore) -> None:
        loop = self.runtime.loop
        if isinstance(message, protocol.Add):
            self._add(router, peer, message)
        elif isinstance(message, protocol.Abort) and loop is not None:
            frontend = self._frontend_of(peer)
            with self._compiling_lock:
                if (frontend, message.rid) in self._compiling:
                    self._compiling[(frontend, message.rid)] = True
            loop.abort(frontend, message.rid)
        elif isinstance(message, protocol.StatsQuery):
            counters = self.runtime.counters() if loop is not None else protocol.CacheCounters()
            router.send_multipart(
                [peer, protocol.encode(protocol.StatsReply(message.qid, counters))]
            )
        elif isinstance(message, (protocol.LoadAdapter, protocol.UnloadAdapter)):
            self._adapter_command(peer, message)
        elif isinstance(message, protocol.Hello):
            self._peers[message.frontend] = peer
            self._sinks[message.frontend] = FrontendSink(
                message.frontend, message.outputs, self.context
            )
            if self._ready_sent:
                router.send_multipart([peer, protocol.encode(self._ready())])
            elif self._tokenizer_saved:
                saved = protocol.TokenizerSaved(str(self._tokenizer_dir))
                router.send_multipart([peer, protocol.encode(saved)])

    def _add(self, router: Any, peer: bytes, message: protocol.Add) -> None:
        from service.core.scheduler.request import Request
        from service.core.scheduler.scheduler import QueueFullError

        loop = self.runtime.loop
        assert loop is not None
        frontend = self._frontend_of(peer)
        req = Request(message.request, self._sinks[frontend], rid=message.rid)
        if message.trace is not None:
            trace_ids.register(req.request_id, message.trace)
        fmt = message.request.response_format
        if fmt is None:
            try:
                loop.submit(req)
            except QueueFullError as exc:
                rejected = protocol.Rejected(message.rid, str(exc))
                router.send_multipart([peer, protocol.encode(rejected)])
            return
        cache = self.runtime.grammar
        if cache is None:
            refusal = GrammarError("structured output is not available for this model")
            self._refuse_format(peer, req, refusal, fmt.kind)
            return
        key = (frontend, message.rid)
        with self._compiling_lock:
            self._compiling[key] = False
        cache.submit(fmt).add_done_callback(
            lambda future: self._compiled(peer, key, req, fmt.kind, future)
        )

    def _compiled(
        self, peer: bytes, key: tuple[str, int], req: Request, kind: str, future: Future
    ) -> None:
        """A request's response format compiled (on the compile's thread): queue the request,
        unless it was aborted meanwhile or its format refused."""
        from service.core.scheduler.scheduler import QueueFullError

        with self._compiling_lock:
            aborted = self._compiling.pop(key, False)
        error = future.exception()
        if aborted:
            forget_trace(req)
            return
        if isinstance(error, GrammarError):
            self._refuse_format(peer, req, error, kind)
            return
        if error is not None:
            self._refuse_format(peer, req, GrammarError(f"compiling failed: {error!r}"), kind)
            return
        req.grammar = future.result()
        loop = self.runtime.loop
        assert loop is not None
        try:
            loop.submit(req)
        except QueueFullError as exc:
            forget_trace(req)
            self._send_later(peer, protocol.Rejected(req.rid, str(exc)))

    def _refuse_format(self, peer: bytes, req: Request, error: GrammarError, kind: str) -> None:
        log.info("response format refused", request_id=req.request_id, reason=error.reason)
        forget_trace(req)
        refused = protocol.Rejected(
            req.rid, error.reason, "invalid_format", format_field(kind), error.code
        )
        self._send_later(peer, refused)

    def _adapter_command(
        self, peer: bytes, message: protocol.LoadAdapter | protocol.UnloadAdapter
    ) -> None:
        loop, qid = self.runtime.loop, message.qid

        def reply(outcome: protocol.AdapterReply) -> None:  # on the loop thread
            outcome.qid = qid
            self._send_later(peer, outcome)

        if loop is None:
            reply(protocol.AdapterReply(qid, error="the model is loading", reason="refused"))
        elif isinstance(message, protocol.LoadAdapter):
            loop.load_adapter(message.name, message.path, reply)
        else:
            loop.unload_adapter(message.name, reply)

    def _reject_request(self, seq: Request, message: str) -> None:
        """On the loop thread: a request whose adapter is no longer served."""
        forget_trace(seq)
        peer = self._peers.get(str(seq.sink.batch_key))
        if peer is not None:
            self._send_later(peer, protocol.Rejected(seq.rid, message, reason="adapter"))

    @property
    def _tokenizer_dir(self) -> Path:
        return self.run_dir / "tokenizer"

    def _save_tokenizer(self, tokenizer: Tokenizer) -> None:
        """On the loop thread, while the model loads: write the tokenizer for the front ends
        and tell them, so that they load it while the weights are still being made."""
        tokenizer.save(self._tokenizer_dir)
        self._tokenizer_saved = True
        self._send_later(None, protocol.TokenizerSaved(str(self._tokenizer_dir)))

    def _send_later(self, peer: bytes | None, message: Any) -> None:
        """Queue a message for a front end (None: every front end) and wake the main thread."""
        self._outgoing.put((peer, protocol.encode(message)))
        os.write(self._wake_write, b"\0")

    def _send_outgoing(self, router: Any) -> None:
        while True:
            try:
                peer, data = self._outgoing.get_nowait()
            except queue.Empty:
                return
            for target in self._peers.values() if peer is None else (peer,):
                router.send_multipart([target, data])

    def _frontend_of(self, peer: bytes) -> str:
        return next(f for f, p in self._peers.items() if p == peer)

    def _announce(self, router: Any) -> None:
        """Once loaded, tell every front end the model is ready."""
        if not self._ready_sent and self.runtime.serving:
            ready = protocol.encode(self._ready())
            for peer in self._peers.values():
                router.send_multipart([peer, ready])
            self._ready_sent = True

    def _load_failed(self, router: Any) -> bool:
        error = self.runtime.load_error
        if error is None:
            return False
        if not self._peers:
            if self._failed_at is None:
                self._failed_at = time.monotonic()
            if time.monotonic() - self._failed_at < HELLO_WAIT_S:
                return False  # not yet: nobody would hear why
        failed = protocol.encode(protocol.LoadFailed(str(error)))
        for peer in self._peers.values():
            router.send_multipart([peer, failed])
        # A front end that has not said hello yet learns it from the exit code.
        log.error("loading the model failed", error=str(error))
        return True

    def _ready(self) -> protocol.Ready:
        rt = self.runtime
        assert rt.loaded is not None
        if not self._tokenizer_saved:  # a load that never told of its tokenizer
            rt.loaded.tokenizer.save(self._tokenizer_dir)
            self._tokenizer_saved = True
        return protocol.Ready(
            model_info=rt.model_info(),
            tokenizer_dir=str(self._tokenizer_dir),
            eos_token_ids=sorted(rt.eos_token_ids),
            slot_context=rt.slot_context,
            capacity_tokens=rt.capacity_tokens,
            pid=os.getpid(),
            prompt_cache=not self.config.kv.no_prompt_cache,
        )


def forget_trace(seq: Request) -> None:
    """A request's final output went out: its log lines no longer need its trace ids."""
    trace_ids.unregister(seq.request_id, linger=True)


def run(
    config: CoreConfig, run_dir: str, alive: Connection, rank: int = 0, env: dict | None = None
) -> None:
    """An engine-core process's entry point (multiprocessing, spawn). `alive`: the writing end
    of the pipe the front ends watch; held (never written) until this process exits. Under
    tensor parallel, `rank` and `env` (the distributed backend's variables, set before MLX is
    imported): rank 0 serves the front ends, the others follow it
    (service.core.tensor_parallel)."""
    os.environ.update(env or {})
    error = mlx_error()
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    configure_logging(config.observability.log_level, config.observability.log_format)
    if rank > 0:
        exit_now(_follow(config, Path(run_dir), rank))
    core = CoreServer(config, Path(run_dir))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: core.stop())
    exit_now(core.serve())  # serve's clean-up done; the loop thread released its streams


def _follow(config: CoreConfig, run_dir: Path, rank: int) -> int:
    from service.core.runtime import Runtime
    from service.core.tensor_parallel import follow

    signal.signal(signal.SIGTERM, _exit_at_once)
    try:
        runtime = Runtime(config, run_dir)
        runtime.load()
        follow(runtime.runner, run_dir, rank)
    except Exception as exc:
        log.error("tensor-parallel rank failed", rank=rank, error=str(exc))
        return 4
    return 0


def _exit_at_once(*_: object) -> None:
    """A follower rank's SIGTERM: it holds nothing to save, and a SystemExit raised wherever
    the signal lands (during the exit's own clean-up too) would print a traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
