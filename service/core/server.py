"""The engine-core process: the only process that imports MLX.

It loads the model and runs the scheduler, the KV cache manager and the model runner
(service.core.runtime) on its engine thread. Its main thread serves the front ends over ZeroMQ
(service.protocol): it registers them, queues their requests into the scheduler, cancels what they
abort, and answers their stats queries from the snapshot the scheduler publishes. The engine
thread sends each front end one `Outputs` message per tick, straight from the scheduler's
outbox (`FrontendSink`).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from service import protocol
from service.common import trace_ids
from service.common.backend import mlx_error
from service.common.config import CoreConfig
from service.common.logging import configure_logging
from service.protocol import StepOutput

if TYPE_CHECKING:
    from service.core.runtime import Runtime
    from service.core.scheduler.request import Request

log = structlog.get_logger(__name__)
POLL_MS = 50  # how often the main thread looks up from its socket when nothing arrives


class FrontendSink:
    """Where the requests of one front end deliver their outputs: a PUSH socket to its PULL,
    made and used on the engine thread only (zmq sockets are not thread-safe)."""

    def __init__(self, frontend: str, address: str, core: CoreServer) -> None:
        self.batch_key = frontend
        self._address = address
        self._core = core
        self._socket: Any = None

    def deliver(self, outputs: list[StepOutput]) -> None:
        if self._socket is None:
            self._socket = self._core.context.socket(zmq.PUSH)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self._address)
        self._socket.send(protocol.encode(protocol.Outputs(outputs)), copy=False)
        for out in outputs:
            if out.final is not None:
                req = self._core.requests.pop((self.batch_key, out.rid), None)
                if req is not None:
                    trace_ids.unregister(req.request_id, linger=True)

    def close(self) -> None:
        """After the engine thread has ended."""
        if self._socket is not None:
            self._socket.close(linger=0)


class CoreServer:
    def __init__(self, config: CoreConfig, run_dir: Path) -> None:
        from service.core.runtime import Runtime  # MLX: only ever imported in this process

        self.config = config
        self.run_dir = run_dir
        self.runtime: Runtime = Runtime(config, run_dir)
        self.context = zmq.Context()
        # (front end, rid) -> request, until its final output
        self.requests: dict[tuple[str, int], Request] = {}
        self._sinks: dict[str, FrontendSink] = {}
        self._peers: dict[str, bytes] = {}  # front end -> its ROUTER identity
        self._notices: queue.SimpleQueue[protocol.FromCore] = queue.SimpleQueue()
        self._ready_sent = False
        self._stopping = threading.Event()
        self.runtime.on_engine_health = lambda ok: self._notices.put(protocol.Health(ok))

    def serve(self) -> int:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(protocol.core_address(self.run_dir))
        self.runtime.start()
        parent = os.getppid()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if os.getppid() != parent:
                    log.error("the server process is gone; the engine core stops")
                    break
                if dict(poller.poll(POLL_MS)).get(router):
                    while True:
                        try:
                            peer, data = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(router, peer, protocol.decode_to_core(data))
                if self._load_failed(router):
                    return 2
                if self._ready_sent and not self.runtime.engine_running:
                    log.error("the engine thread stopped: the engine core exits")
                    return 4
                self._announce(router)
        finally:
            self.runtime.shutdown()  # ends what still runs (their final outputs go out)
            for sink in self._sinks.values():
                sink.close()
            router.close(linger=0)
            self.context.term()
        return 0

    def stop(self) -> None:
        self._stopping.set()

    # -- messages ----------------------------------------------------------------------
    def _handle(self, router: Any, peer: bytes, message: protocol.ToCore) -> None:
        if isinstance(message, protocol.Add):
            self._add(router, peer, message)
        elif isinstance(message, protocol.Abort):
            req = self.requests.get((self._frontend_of(peer), message.rid))
            if req is not None and self.runtime.scheduler is not None:
                self.runtime.scheduler.cancel(req)
        elif isinstance(message, protocol.StatsQuery):
            stats = self.runtime.cache_stats().SerializeToString()
            router.send_multipart([peer, protocol.encode(protocol.StatsReply(message.qid, stats))])
        elif isinstance(message, protocol.Hello):
            self._peers[message.frontend] = peer
            self._sinks[message.frontend] = FrontendSink(message.frontend, message.outputs, self)
            if self._ready_sent:
                router.send_multipart([peer, protocol.encode(self._ready())])

    def _add(self, router: Any, peer: bytes, message: protocol.Add) -> None:
        from service.core.scheduler.request import Request
        from service.core.scheduler.scheduler import QueueFullError

        frontend = self._frontend_of(peer)
        req = Request(message.request, self._sinks[frontend], rid=message.rid)
        assert self.runtime.scheduler is not None
        self.requests[frontend, message.rid] = req
        if message.trace is not None:
            trace_ids.register(req.request_id, message.trace)
        try:
            self.runtime.scheduler.submit(req)
        except QueueFullError as exc:
            self.requests.pop((frontend, message.rid), None)
            router.send_multipart([peer, protocol.encode(protocol.Rejected(message.rid, str(exc)))])

    def _frontend_of(self, peer: bytes) -> str:
        return next(f for f, p in self._peers.items() if p == peer)

    def _announce(self, router: Any) -> None:
        """Once loaded, tell every front end the model is ready; pass on health notices."""
        if not self._ready_sent and self.runtime.serving:
            ready = protocol.encode(self._ready())
            for peer in self._peers.values():
                router.send_multipart([peer, ready])
            self._ready_sent = True
        while not self._notices.empty():
            notice = protocol.encode(self._notices.get())
            for peer in self._peers.values():
                router.send_multipart([peer, notice])

    def _load_failed(self, router: Any) -> bool:
        error = self.runtime.load_error
        if error is None:
            return False
        failed = protocol.encode(protocol.LoadFailed(str(error)))
        for peer in self._peers.values():
            router.send_multipart([peer, failed])
        # A front end that has not said hello yet learns it from the exit code.
        log.error("loading the model failed", error=str(error))
        return True

    def _ready(self) -> protocol.Ready:
        rt = self.runtime
        assert rt.loaded is not None
        tokenizer_dir = self.run_dir / "tokenizer"
        if not tokenizer_dir.exists():
            rt.loaded.tokenizer.save(tokenizer_dir)
        return protocol.Ready(
            model_info=rt.model_info().SerializeToString(),
            tokenizer_dir=str(tokenizer_dir),
            eos_token_ids=sorted(rt.eos_token_ids),
            slot_context=rt.slot_context,
            capacity_tokens=rt.capacity_tokens,
            pid=os.getpid(),
            prompt_cache=not self.config.kv.no_prompt_cache,
        )


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
        sys.exit(_follow(config, Path(run_dir), rank))
    core = CoreServer(config, Path(run_dir))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: core.stop())
    sys.exit(core.serve())


def _follow(config: CoreConfig, run_dir: Path, rank: int) -> int:
    from service.core.runtime import Runtime
    from service.core.tensor_parallel import follow

    signal.signal(signal.SIGTERM, _exit_at_once)
    try:
        runtime = Runtime(config, run_dir)
        runtime.load()
        follow(runtime.engine, run_dir, rank)
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
