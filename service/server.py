"""The gRPC server: GenerationService, health and reflection on one grpc.aio server."""

from __future__ import annotations

import asyncio
import signal

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service import transport
from service.config import ConfigError, ServerConfig
from service.introspection import HealthServicer, enable_server_reflection
from service.request_decoding import DecodeErrorInterceptor
from service.runtime import Runtime
from service.servicer import GenerationServicer
from service.telemetry.telemetry import Telemetry

log = structlog.get_logger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


async def serve(config: ServerConfig) -> None:
    telemetry = Telemetry.from_config(config)  # tracing from OTEL_*, metrics on --metrics-port
    runtime = Runtime(config, telemetry)
    auth = transport.auth_interceptor(config)
    server = grpc.aio.server(
        # Innermost last: tracing sees an undecodable request's INVALID_ARGUMENT like any other;
        # authentication refuses before anything decodes the request.
        interceptors=[
            *telemetry.server_interceptors(SERVICE_NAME),
            *([auth] if auth is not None else []),
            DecodeErrorInterceptor(),
        ],
        options=transport.server_options(config),
    )
    servicer = GenerationServicer(runtime)
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    bound = transport.bind(server, config)  # TLS when --tls-cert is set
    if bound == 0:
        raise ConfigError(f"could not bind {address}: is another server using the port?")
    if config.metrics_port:
        try:
            telemetry.start_metrics_server(config.host, config.metrics_port, runtime.cache_stats)
        except OSError as exc:
            message = f"could not serve metrics on port {config.metrics_port}: {exc}"
            raise ConfigError(message) from exc
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("listening; loading the model", address=address, tls=config.tls_cert is not None)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def set_health(healthy: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if healthy
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        if runtime.serving:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)

    # The engine thread reports when repeated steps fail (and when it recovers).
    runtime.on_engine_health = lambda healthy: asyncio.run_coroutine_threadsafe(
        set_health(healthy), loop
    )
    # Load on the engine thread, off the event loop, so health and reflection answer while the
    # weights load.
    runtime.start()
    load = loop.run_in_executor(None, runtime.wait_ready)
    done, _ = await asyncio.wait(
        {load, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    if load in done:
        if load.exception() is not None:
            await server.stop(0)  # a failed load ends the server with its error
            servicer.close()
            raise load.exception()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", address=address)
        await stop.wait()

    log.info("draining", grace_seconds=config.drain_seconds)
    runtime.draining = True
    runtime.serving = False
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=config.drain_seconds)
    servicer.close()
    runtime.shutdown()
    telemetry.shutdown()  # exports the spans still buffered
    log.info("stopped")
