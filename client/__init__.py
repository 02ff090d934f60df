"""Python client for mlxserve: sync and asyncio gRPC clients, a request builder, and a CLI."""

from client.client import (
    DEFAULT_TARGET,
    AsyncGenerationClient,
    Balancing,
    GenerationClient,
    TLSConfig,
    build_request,
    to_generate_request,
    to_stream_request,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncGenerationClient",
    "Balancing",
    "GenerationClient",
    "TLSConfig",
    "build_request",
    "to_generate_request",
    "to_stream_request",
]
