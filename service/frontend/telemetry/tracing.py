"""OpenTelemetry tracing: a TracerProvider from the standard OTEL_* environment variables.

Tracing is on when an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or OTEL_TRACES_EXPORTER names `otlp`; it is off otherwise,
and off whenever OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true. When it is off nothing of
the SDK is imported and no span is made: the request path pays nothing for it.

When on: one SERVER span per GenerationService RPC, opened by the RpcObserver interceptor
(service.frontend.telemetry.rpc), which continues the caller's W3C trace context (`traceparent`,
`tracestate` in the invocation metadata, through the global propagator: tracecontext + baggage
unless OTEL_PROPAGATORS says otherwise). Spans leave through a BatchSpanProcessor and the OTLP/gRPC
exporter; the SDK reads everything else itself (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*, OTEL_EXPORTER_OTLP_[TRACES_]{INSECURE,HEADERS,TIMEOUT,...}).
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_SERVICE_NAME = "mlxserve"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_requested(env: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """Whether the environment asks for trace export."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {
        e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()
    }
    if "none" in exporters:
        return False
    return "otlp" in exporters or any(env.get(name, "").strip() for name in _ENDPOINT_VARS)


def trace_endpoint(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    for name in _ENDPOINT_VARS:
        if env.get(name, "").strip():
            return env[name].strip()
    return "http://localhost:4317"  # the exporter's own default


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxserve")
    except PackageNotFoundError:
        return "unknown"


class Tracing:
    """The configured SDK TracerProvider (also installed as the global one)."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({SERVICE_VERSION: _package_version()})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        # No sampler argument: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG.
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(self.provider)
        self.service_name = str(self.provider.resource.attributes.get(SERVICE_NAME))
        self.endpoint = trace_endpoint()
        self.tracer = self.provider.get_tracer("mlxserve", _package_version())

    def shutdown(self, flush_timeout_s: float = 3.0) -> None:
        """Export what is still buffered, then stop the exporter."""
        self.provider.force_flush(int(flush_timeout_s * 1000))
        self.provider.shutdown()


def current_span() -> Any:
    from opentelemetry import trace

    return trace.get_current_span()


def span_ids(span: Any) -> tuple[str, str] | None:
    """(trace_id, span_id) as lower-case hex, or None for an invalid span context."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
