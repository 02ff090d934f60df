"""The telemetry facade: traces, metrics and trace ids in logs, behind small hooks.

`Telemetry` is built once per server from the environment (tracing) and --metrics-port
(metrics). The servicer calls its request hooks; the scheduler calls `observer`, a
`TelemetryObserver` fanning lifecycle events out to the request's RPC span and to the metrics.
With tracing and metrics both off, `observer` is the scheduler's no-op observer and every hook
returns at its first line.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from service.scheduler.request import FinishReason, Sequence, StepOutput
from service.scheduler.scheduler import SchedulerObserver
from service.telemetry import logs
from service.telemetry.metrics import Metrics
from service.telemetry.tracing import Tracing, current_span, set_error, span_ids, tracing_requested

log = structlog.get_logger(__name__)


class RequestTelemetry:
    """Per-request state, kept on `Sequence.telemetry`."""

    __slots__ = ("ids", "last_token_at", "span")

    def __init__(self, span: Any, ids: tuple[str, str] | None) -> None:
        self.span = span  # the RPC span when it records, else None
        self.ids = ids  # (trace_id, span_id) hex, when the span context is valid
        self.last_token_at: float | None = None


class TelemetryObserver(SchedulerObserver):
    """Scheduler lifecycle events -> span events on the request's RPC span, and metrics.

    Called on the scheduler thread; the SDK's Span.add_event is thread-safe."""

    def __init__(self, metrics: Metrics | None) -> None:
        self.metrics = metrics

    def on_event(self, seq: Sequence, name: str, **attrs: object) -> None:
        state: RequestTelemetry | None = seq.telemetry
        span = state.span if state is not None else None
        if span is not None:
            span.add_event(name, attrs)
            if name == "finished":
                span.set_attributes(
                    {
                        "mlxserve.finish_reason": str(attrs.get("finish_reason")),
                        "mlxserve.completion_tokens": seq.num_generated,
                        "mlxserve.cached_tokens": seq.cached_tokens,
                        "mlxserve.preemptions": seq.preemptions,
                    }
                )
                if attrs.get("finish_reason") == FinishReason.ERROR.value:
                    set_error(span, "inference backend error")
        m = self.metrics
        if m is None:
            return
        if name == "first_token":
            if seq.first_token_at is not None:
                m.ttft.observe(seq.first_token_at - seq.arrival)
        elif name == "finished":
            m.requests.labels(str(attrs.get("finish_reason"))).inc()
        elif name == "preempted":
            m.preemptions.inc()


class Telemetry:
    def __init__(self, tracing: Tracing | None = None, metrics: Metrics | None = None) -> None:
        self.tracing = tracing
        self.metrics = metrics
        self.enabled = tracing is not None or metrics is not None
        self.observer: SchedulerObserver = (
            TelemetryObserver(metrics) if self.enabled else SchedulerObserver()
        )
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
    def request_started(self, seq: Sequence, queue_depth: int) -> None:
        """Before the sequence is submitted: take the RPC span (current in this task), give it
        the request's attributes and a "queued" event, and register its ids for the logs."""
        if not self.enabled:
            return
        span, ids = None, None
        if self.tracing is not None:
            current = current_span()
            ids = span_ids(current)
            if current.is_recording():
                span = current
                req = seq.request
                span.set_attributes(
                    {
                        "mlxserve.request_id": req.request_id,
                        "mlxserve.prompt_tokens": len(req.prompt_token_ids),
                        "mlxserve.max_tokens": req.max_tokens,
                        "mlxserve.priority": req.priority,
                    }
                )
                span.add_event("queued", {"queue_depth": queue_depth})
            if ids is not None:
                logs.register(seq.request_id, ids)
        seq.telemetry = RequestTelemetry(span, ids)

    def request_outputs(self, seq: Sequence, outputs: list[StepOutput]) -> None:
        """One delivery of a tick's outputs to the RPC: generated tokens, inter-token latency."""
        m = self.metrics
        state: RequestTelemetry | None = seq.telemetry
        if m is None or state is None:
            return
        n = 0
        for out in outputs:
            n += len(out.token_ids)
        if not n:
            return
        now = time.monotonic()
        m.generated_tokens.inc(n)
        if state.last_token_at is not None:
            gap = (now - state.last_token_at) / n
            for _ in range(n):
                m.itl.observe(gap)
        state.last_token_at = now

    def request_ended(self, seq: Sequence, submitted: bool = True) -> None:
        """The RPC is over (finished, failed, cancelled, or never `submitted`: the queue was
        full); its span is about to end."""
        state: RequestTelemetry | None = seq.telemetry
        if state is None:
            return
        # A submitted sequence the scheduler has not finished was left by its client; the
        # scheduler's "request finished" line about it is still to come.
        left = submitted and not seq.is_finished
        if state.span is not None:
            if left:
                state.span.add_event("cancelled_by_client", {"generated": seq.num_generated})
            elif not submitted:
                state.span.add_event("rejected", {"reason": "queue_full"})
            state.span = None  # the scheduler's later events (e.g. "finished") skip the span
        if state.ids is not None:
            logs.unregister(seq.request_id, linger=left)

    def rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejections.labels(reason).inc()
