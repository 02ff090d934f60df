"""The telemetry facade: traces, metrics and trace ids in logs, behind small hooks.

`Telemetry` is built once per front-end process from the environment (tracing) and
--metrics-port (metrics). The servicer calls its request hooks, including with the lifecycle
events the engine core sends with each request's outputs (queued, admitted, prefill chunks,
first token, preempted, finished), which become events on the request's RPC span and metrics.
With tracing and metrics both off, every hook returns at its first line.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from service.scheduler.request import FinishReason, GenerationRequest
from service.telemetry import logs
from service.telemetry.metrics import Metrics
from service.telemetry.tracing import Tracing, current_span, set_error, span_ids, tracing_requested

log = structlog.get_logger(__name__)


class RequestTelemetry:
    """Per-request state, kept by the RPC that serves the request."""

    __slots__ = ("ids", "last_token_at", "request_id", "span")

    def __init__(self, request_id: str, span: Any, ids: tuple[str, str] | None) -> None:
        self.request_id = request_id
        self.span = span  # the RPC span when it records, else None
        self.ids = ids  # (trace_id, span_id) hex, when the span context is valid
        self.last_token_at: float | None = None


class Telemetry:
    def __init__(self, tracing: Tracing | None = None, metrics: Metrics | None = None) -> None:
        self.tracing = tracing
        self.metrics = metrics
        self.enabled = tracing is not None or metrics is not None
        if tracing is not None:
            logs.enable_current_span_lookup()

    @classmethod
    def from_config(cls, config: Any) -> Telemetry:
        """Tracing from the OTEL_* environment; metrics when --metrics-port is set."""
        tracing = Tracing() if tracing_requested() else None
        metrics = Metrics() if config.metrics_port else None
        if tracing is not None:
            log.info(
                "tracing on", endpoint=tracing.endpoint, otel_service_name=tracing.service_name
            )
        return cls(tracing, metrics)

    # -- server wiring ------------------------------------------------------------------
    def server_interceptors(self, service_name: str) -> list[Any]:
        return self.tracing.server_interceptors(service_name) if self.tracing else []

    def start_metrics_server(self, host: str, port: int, cache_stats: Any) -> None:
        """Serve /metrics; the gauges read `cache_stats()` at each scrape."""
        if self.metrics is None:
            return
        self.metrics.watch_runtime(cache_stats)
        self.metrics.serve(host, port)
        log.info("metrics on", address=f"{host}:{port}", path="/metrics")

    def shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.shutdown()
        if self.tracing is not None:
            self.tracing.shutdown()

    # -- hooks: the servicer --------------------------------------------------------------
    def request_started(self, request: GenerationRequest) -> RequestTelemetry | None:
        """Before the request is submitted: take the RPC span (current in this task), give it
        the request's attributes, and register its ids for the logs."""
        if not self.enabled:
            return None
        span, ids = None, None
        if self.tracing is not None:
            current = current_span()
            ids = span_ids(current)
            if current.is_recording():
                span = current
                span.set_attributes(
                    {
                        "mlxserve.request_id": request.request_id,
                        "mlxserve.prompt_tokens": len(request.prompt_token_ids),
                        "mlxserve.max_tokens": request.max_tokens,
                        "mlxserve.priority": request.priority,
                    }
                )
            if ids is not None:
                logs.register(request.request_id, ids)
        return RequestTelemetry(request.request_id, span, ids)

    def request_events(
        self, state: RequestTelemetry | None, events: list[tuple[str, dict[str, Any]]]
    ) -> None:
        """The engine core's lifecycle events of the request: span events and metrics."""
        if state is None:
            return
        span, m = state.span, self.metrics
        for name, attrs in events:
            if span is not None:
                span.add_event(name, attrs)
                if name == "finished":
                    span.set_attributes(
                        {
                            "mlxserve.finish_reason": str(attrs.get("finish_reason")),
                            "mlxserve.completion_tokens": int(attrs.get("completion_tokens", 0)),
                            "mlxserve.cached_tokens": int(attrs.get("cached_tokens", 0)),
                            "mlxserve.preemptions": int(attrs.get("preemptions", 0)),
                        }
                    )
                    if attrs.get("finish_reason") == FinishReason.ERROR.value:
                        set_error(span, "inference backend error")
            if m is None:
                continue
            if name == "first_token":
                m.ttft.observe(float(attrs.get("ttft_seconds", 0.0)))
            elif name == "finished":
                m.requests.labels(str(attrs.get("finish_reason"))).inc()
            elif name == "preempted":
                m.preemptions.inc()

    def request_tokens(self, state: RequestTelemetry | None, n: int) -> None:
        """n generated tokens reached the RPC: the generated-tokens counter, inter-token
        latency."""
        m = self.metrics
        if m is None or state is None or not n:
            return
        now = time.monotonic()
        m.generated_tokens.inc(n)
        if state.last_token_at is not None:
            gap = (now - state.last_token_at) / n
            for _ in range(n):
                m.itl.observe(gap)
        state.last_token_at = now

    def request_ended(
        self, state: RequestTelemetry | None, finished: bool, generated: int = 0
    ) -> None:
        """The RPC is over: finished by the engine, or left by its client (cancelled)."""
        if state is None:
            return
        if state.span is not None:
            if not finished:
                state.span.add_event("cancelled_by_client", {"generated": generated})
            state.span = None
        if state.ids is not None:
            logs.unregister(state.request_id, linger=not finished)

    def rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejections.labels(reason).inc()
