"""A gRPC front end: GenerationService, health and reflection on one grpc.aio server.

It serves while the engine core (another process, service.core.server) loads the model: health says
NOT_SERVING and generation answers UNAVAILABLE until the core reports the model ready. If the
core dies, every open RPC ends with UNAVAILABLE, health goes NOT_SERVING, and `serve_frontend`
returns CORE_DIED_EXIT so that the server exits non-zero (a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.common.config import ConfigError, FrontendProcessConfig
from service.common.tokenizer import Tokenizer
from service.frontend import transport
from service.frontend.core_client import CoreClient, LoadFailedError
from service.frontend.introspection import HealthServicer, enable_server_reflection
from service.frontend.request_decoding import DecodeErrorInterceptor
from service.frontend.servicer import GenerationServicer, served_model
from service.frontend.telemetry.telemetry import Telemetry
from service.protocol import CacheCounters

log = structlog.get_logger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
LOAD_FAILED_EXIT = 2
CORE_DIED_EXIT = 3
DRAIN_LAST_MESSAGES_S = 2.0  # for the final messages of requests the drain ended
STATS_TIMEOUT_S = 2.0
LOAD_FAILURE_GRACE_S = 3.0  # a scrape waits this long for the core's CacheStats


async def serve_frontend(
    config: FrontendProcessConfig,
    run_dir: Path,
    index: int,
    core_alive: list[Connection],
    on_stop: Callable[[], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (then drain) or until the core dies. `core_alive`: per
    engine-core rank, a pipe end that reads EOF once that process is gone; `on_stop`: called
    when a stop signal arrives. Returns the exit code."""
    return await Frontend(config, run_dir, index, core_alive, on_stop).serve()


class Frontend:
    """One front-end process's gRPC server, from start-up through the core's Ready to the
    drain."""

    def __init__(
        self,
        config: FrontendProcessConfig,
        run_dir: Path,
        index: int,
        core_alive: list[Connection],
        on_stop: Callable[[], None] | None,
    ) -> None:
        self.config = config
        self.index = index
        self.core_alive = core_alive
        self.on_stop = on_stop
        # Tracing from OTEL_*, metrics on --metrics-port.
        self.telemetry = Telemetry.from_config(config)
        self.client = CoreClient(run_dir, index)
        self.server = self._grpc_server()
        self.servicer = GenerationServicer(config, self.client, self.telemetry)
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), self.server)
        self.address = f"{config.transport.host}:{config.transport.port}"
        self.listening = False
        self.stop = asyncio.Event()
        self.stop_now = asyncio.Event()  # a second signal: no more waiting
        self.exit_code = 0
        # The model's tokenizer, loading since the core saved it (while its weights load).
        self._tokenizer: asyncio.Future[Tokenizer] | None = None

    def _grpc_server(self) -> grpc.aio.Server:
        config = self.config
        auth = transport.auth_interceptor(config.transport)
        return grpc.aio.server(
            # Innermost last: the RPC observer (spans, gRPC metrics) sees every RPC's final
            # status, an authentication refusal's or an undecodable request's too;
            # authentication refuses before anything decodes the request.
            interceptors=[
                *self.telemetry.server_interceptors(SERVICE_NAME),
                *([auth] if auth is not None else []),
                DecodeErrorInterceptor(),
            ],
            options=transport.server_options(config.transport, config.frontend.api_workers),
        )

    async def serve(self) -> int:
        await self.set_health(False)
        # Front end 0 listens at once, to answer NOT_SERVING while the model loads. The others
        # listen only once ready: the kernel hands each new connection to any listener on the
        # port, and a caller that found the server SERVING must not reach one still loading.
        if self.index == 0:
            await self.listen("listening; the engine core loads the model")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        for pipe in self.core_alive:
            loop.add_reader(pipe.fileno(), self._on_core_exit)
        self.client.on_health = lambda healthy: asyncio.ensure_future(
            self.set_health(healthy and self.servicer.serving)
        )
        self.client.on_tokenizer_saved = self._load_tokenizer
        try:
            if await self._until_ready():
                await self.stop.wait()
        finally:
            await self._shut_down()
        return self.exit_code

    async def listen(self, event: str) -> None:
        bound = transport.bind(self.server, self.config.transport)  # TLS with --tls-cert
        if bound == 0:
            raise ConfigError(f"could not bind {self.address}: is another server using the port?")
        await self.server.start()
        self.listening = True
        tls = self.config.transport.tls_cert is not None
        log.info(event, address=self.address, frontend=self.index, tls=tls)

    async def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status.SERVING if serving else status.NOT_SERVING)

    def _on_signal(self) -> None:
        if self.stop.is_set():
            log.warning("second stop signal: stopping now", frontend=self.index)
            self.stop_now.set()
            return
        if self.on_stop is not None:
            self.on_stop()
        self.stop.set()

    def _load_tokenizer(self, directory: str) -> None:
        if self._tokenizer is None:
            loop = asyncio.get_running_loop()
            self._tokenizer = loop.run_in_executor(None, Tokenizer.load, Path(directory))

    def _on_core_exit(self) -> None:
        loop = asyncio.get_running_loop()
        for pipe in self.core_alive:
            loop.remove_reader(pipe.fileno())
        if self.stop.is_set():
            return  # we are stopping it ourselves
        if self.servicer.model is None:
            # While loading, a rank may exit because the model cannot be loaded: give rank 0's
            # reason (LoadFailed) a moment to arrive before calling it a crash.
            loop.call_later(LOAD_FAILURE_GRACE_S, self._core_gone)
        else:
            self._core_gone()

    def _core_gone(self) -> None:
        if self.stop.is_set():
            return
        log.error("the engine core exited: ending every open request", frontend=self.index)
        self.exit_code = CORE_DIED_EXIT
        self.client.core_died()
        self.stop.set()

    async def _until_ready(self) -> bool:
        """Wait for the core's model (or a stop); then serve it. False: stopped first."""
        connect = asyncio.ensure_future(self.client.connect())
        waiter = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({connect, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not connect.done():
            connect.cancel()
            return False
        try:
            ready = connect.result()
        except LoadFailedError as exc:
            log.error("the model could not be loaded", error=str(exc))
            self.exit_code = self.exit_code or LOAD_FAILED_EXIT
            raise
        loop = asyncio.get_running_loop()
        tokenizer = await self._tokenizer if self._tokenizer is not None else None
        self.servicer.set_model(
            await loop.run_in_executor(
                None, served_model, ready, self.config.structured, self.telemetry, tokenizer
            )
        )
        self.telemetry.model_ready(self.servicer.model.info.model_id)
        if self.config.observability.metrics_port and self.index == 0:
            _serve_metrics(self.config, self.telemetry, self.client, ready.pid)
        await self.set_health(True)
        if self.listening:
            log.info("serving", address=self.address, frontend=self.index)
        else:
            await self.listen("serving")
        return True

    async def _shut_down(self) -> None:
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        if not self.exit_code:
            await _drain(
                self.servicer, self.config.frontend.drain_timeout, self.stop_now, self.index
            )
        if self.listening:
            await self.server.stop(grace=0 if self.stop_now.is_set() else DRAIN_LAST_MESSAGES_S)
        self.servicer.close()
        loop = asyncio.get_running_loop()
        for pipe in self.core_alive:
            with contextlib.suppress(Exception):
                loop.remove_reader(pipe.fileno())
        await self.client.close_sockets()
        self.telemetry.shutdown()  # exports the spans still buffered
        log.info("stopped", frontend=self.index)


async def _drain(
    servicer: GenerationServicer, timeout: float, stop_now: asyncio.Event, index: int
) -> None:
    """Let running requests finish for up to `timeout` seconds (new ones get UNAVAILABLE with
    RetryInfo); then end what still runs as cancelled, each with a final message."""
    log.info("draining", timeout_seconds=timeout, frontend=index)
    idle = asyncio.ensure_future(servicer.client.idle.wait())
    now = asyncio.ensure_future(stop_now.wait())
    await asyncio.wait({idle, now}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    now.cancel()
    if not idle.done():
        servicer.client.end_all()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(idle, DRAIN_LAST_MESSAGES_S)


def _serve_metrics(
    config: FrontendProcessConfig, telemetry: Telemetry, client: CoreClient, core_pid: int
) -> None:
    """/metrics on this front end; its gauges ask the core for CacheStats at each scrape (from
    the metrics server's thread, through this event loop)."""
    loop = asyncio.get_running_loop()
    latest = [CacheCounters()]

    def cache_stats() -> CacheCounters:
        if not client.gone.is_set():
            with contextlib.suppress(Exception):
                future = asyncio.run_coroutine_threadsafe(client.stats(), loop)
                latest[0] = future.result(STATS_TIMEOUT_S)
        return latest[0]

    try:
        assert config.observability.metrics_port is not None
        telemetry.start_metrics_server(
            config.transport.host, config.observability.metrics_port, cache_stats, core_pid
        )
    except OSError as exc:
        message = f"could not serve metrics on port {config.observability.metrics_port}: {exc}"
        raise ConfigError(message) from exc
