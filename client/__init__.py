"""Python client for mlxserve: sync and asyncio gRPC clients, a request builder, and a CLI."""

from client.client import (
    DEFAULT_TARGET,
    AsyncGenerationClient,
    Balancing,
    GenerationClient,
    TLSConfig,
    build_request,
    response_format,
    to_generate_request,
    to_stream_request,
)
from client.errors import ErrorClass, ErrorDetails, FieldViolation, error_details

__all__ = [
    "DEFAULT_TARGET",
    "AsyncGenerationClient",
    "Balancing",
    "ErrorClass",
    "ErrorDetails",
    "FieldViolation",
    "GenerationClient",
    "TLSConfig",
    "build_request",
    "error_details",
    "response_format",
    "to_generate_request",
    "to_stream_request",
]
