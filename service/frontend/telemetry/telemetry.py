"""The telemetry facade: traces, metrics and trace ids in logs, behind small hooks.

`Telemetry` is built once per front-end process from the environment (tracing) and
--metrics-port (metrics). The servicer calls its request hooks, including with the lifecycle
events the engine core sends with each request's outputs (queued, admitted or resumed, prefill
chunks, first token, preempted, finished), which become events on the request's RPC span and
metrics. The span carries the OpenTelemetry GenAI attributes (`gen_ai.*`) beside the RPC ones.
With tracing and metrics both off, every hook returns at its first line.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from service.common import trace_ids
from service.common.grammar import GrammarError
from service.frontend.telemetry.metrics import Metrics
from service.frontend.telemetry.rpc import RpcObserver
from service.frontend.telemetry.tracing import Tracing, current_span, span_ids, tracing_requested
from service.protocol import Final, FinishReason, GenerationRequest

log = structlog.get_logger(__name__)

PROVIDER = "mlxserve"  # gen_ai.provider.name: the server that runs the model
COMPLETED = frozenset({FinishReason.STOP.value, FinishReason.LENGTH.value})


class RequestTelemetry:
    """Per-request state, kept by the RPC that serves the request."""

    __slots__ = (
        "adapter",
        "finished_event",
        "ids",
        "last_token_at",
        "prompt_tokens",
        "received_at",
        "request_id",
        "span",
        "streaming",
    )

    def __init__(
        self,
        request: GenerationRequest,
        span: Any,
        ids: tuple[str, str] | None,
        received_at: float,
        streaming: bool,
    ) -> None:
        self.request_id = request.request_id
        self.adapter = request.adapter  # "": the base model
        self.prompt_tokens = len(request.prompt_token_ids)
        self.span = span  # the RPC span when it records, else None
        self.ids = ids  # (trace_id, span_id) hex, when the span context is valid
        self.received_at = received_at  # time.monotonic() when the RPC arrived
        self.streaming = streaming
        self.last_token_at: float | None = None
        self.finished_event: dict[str, Any] = {}  # the core's, until the final is known


class Telemetry:
    def __init__(self, tracing: Tracing | None = None, metrics: Metrics | None = None) -> None:
        self.tracing = tracing
        self.metrics = metrics
        self.enabled = tracing is not None or metrics is not None
        self.model = ""
        # The per-token series' children for the current model, looked up once: a `labels`
        # call per message is a good part of what the metrics cost a front end per token.
        self._token_series: tuple[Any, Any] | None = None
        self._adapter_tokens: dict[str, Any] = {}
        if tracing is not None:
            trace_ids.enable_current_span_lookup()

    @classmethod
    def from_config(cls, config: Any) -> Telemetry:
        """Tracing from the OTEL_* environment; metrics when --metrics-port is set."""
        tracing = Tracing() if tracing_requested() else None
        metrics = Metrics() if config.observability.metrics_port else None
        if tracing is not None:
            log.info(
                "tracing on", endpoint=tracing.endpoint, otel_service_name=tracing.service_name
            )
        return cls(tracing, metrics)

    # -- server wiring ------------------------------------------------------------------
    def server_interceptors(self, service_name: str) -> list[Any]:
        """The RPC observer (spans for `service_name`'s RPCs, gRPC metrics for all), when
        tracing or metrics are on."""
        if not self.enabled:
            return []
        tracer = self.tracing.tracer if self.tracing is not None else None
        return [RpcObserver(tracer, service_name, self.metrics)]

    def model_ready(self, model: str) -> None:
        """The engine core loaded `model`: the `model` label and gen_ai.request.model."""
        self.model = model
        self._token_series, self._adapter_tokens = None, {}
        if self.metrics is not None:
            self.metrics.set_model(model)

    def start_metrics_server(
        self, host: str, port: int, cache_stats: Any, core_pid: int | None = None
    ) -> None:
        """Serve /metrics; the gauges read `cache_stats()` at each scrape."""
        if self.metrics is None:
            return
        self.metrics.serve(host, port, cache_stats, core_pid)
        log.info(
            "metrics on",
            address=f"{host}:{port}",
            path="/metrics",
            multiprocess=self.metrics.multiprocess,
        )

    def shutdown(self) -> None:
        if self.metrics is not None:
            self.metrics.shutdown()
        if self.tracing is not None:
            self.tracing.shutdown()

    # -- hooks: the servicer --------------------------------------------------------------
    def rpc_request(self, message: Any, *, streaming: bool) -> None:
        """A generation RPC arrived (not yet validated): what it asks for, on its span."""
        if self.tracing is None:
            return
        span = current_span()
        if not span.is_recording():
            return
        span.set_attributes(
            {
                "gen_ai.operation.name": (
                    "chat" if message.WhichOneof("input") == "chat" else "text_completion"
                ),
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.request.model": self.model,
                "gen_ai.request.stream": streaming,
                "gen_ai.output.type": "text",
            }
        )

    def request_started(
        self, request: GenerationRequest, received_at: float, *, streaming: bool = False
    ) -> RequestTelemetry | None:
        """Before the request is submitted: take the RPC span (current in this task), give it
        the request's attributes, and register its ids for the trace_ids."""
        if not self.enabled:
            return None
        if self.metrics is not None and request.response_format is not None:
            self.metrics.structured_requests.labels(self.model, request.response_format.kind).inc()
        span, ids = None, None
        if self.tracing is not None:
            current = current_span()
            ids = span_ids(current)
            if current.is_recording():
                span = current
                span.set_attributes(self._request_attributes(request))
            if ids is not None:
                trace_ids.register(request.request_id, ids)
        return RequestTelemetry(request, span, ids, received_at, streaming)

    def _request_attributes(self, request: GenerationRequest) -> dict[str, Any]:
        s = request.sampling
        attributes: dict[str, Any] = {
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p,
            "gen_ai.request.frequency_penalty": s.frequency_penalty,
            "gen_ai.request.presence_penalty": s.presence_penalty,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "gen_ai.response.id": request.request_id,
            "gen_ai.response.model": self.model,
            "mlxserve.request_id": request.request_id,
            "mlxserve.priority": request.priority,
        }
        if request.response_format is not None:
            kind = request.response_format.kind
            attributes["mlxserve.response_format"] = kind
            attributes["gen_ai.output.type"] = "json" if kind.startswith("json") else "text"
        if request.adapter:
            attributes["mlxserve.adapter"] = request.adapter
        if s.top_k:
            attributes["gen_ai.request.top_k"] = float(s.top_k)
        if s.seed is not None:
            attributes["gen_ai.request.seed"] = s.seed
        if request.stop:
            attributes["gen_ai.request.stop_sequences"] = list(request.stop)
        return attributes

    def request_events(
        self, state: RequestTelemetry | None, events: list[tuple[str, dict[str, Any]]]
    ) -> None:
        """The engine core's lifecycle events of the request: span events and metrics. The
        core's `finished` waits for `request_finished` (a stop string ends a request on the
        front end: the core only sees it aborted)."""
        if state is None:
            return
        span, m, model = state.span, self.metrics, self.model
        for name, attrs in events:
            if name == "finished":
                state.finished_event = dict(attrs)
                continue
            if span is not None:
                span.add_event(name, attrs)
            if m is None:
                continue
            if name == "first_token":
                m.ttft.labels(model).observe(float(attrs.get("ttft_seconds", 0.0)))
                m.prompt_tokens.labels(model).inc(state.prompt_tokens)
            elif name in ("admitted", "resumed"):
                queried = int(attrs.get("prefix_query_tokens", 0))
                if queried:
                    m.prefix_queries.labels(model).inc(queried)
                    m.prefix_hits.labels(model).inc(int(attrs.get("prefix_hit_tokens", 0)))
            elif name == "preempted":
                m.preemptions.labels(model).inc()

    def request_tokens(self, state: RequestTelemetry | None, n: int) -> None:
        """n generated tokens reached the RPC: the generated-tokens counter, inter-token
        latency."""
        m = self.metrics
        if m is None or state is None or not n:
            return
        now = time.monotonic()
        series = self._token_series
        if series is None:
            series = self._token_series = (
                m.generation_tokens.labels(self.model),
                m.itl.labels(self.model),
            )
        tokens, itl = series
        tokens.inc(n)
        if state.adapter:
            adapter = self._adapter_tokens.get(state.adapter)
            if adapter is None:
                adapter = m.adapter_generation_tokens.labels(self.model, state.adapter)
                self._adapter_tokens[state.adapter] = adapter
            adapter.inc(n)
        if state.last_token_at is not None:
            gap = (now - state.last_token_at) / n
            for _ in range(n):
                itl.observe(gap)
        state.last_token_at = now

    def request_finished(self, state: RequestTelemetry | None, final: Final) -> None:
        """The request ended as its client is told (`final`): usage on the span, the finish
        reason and, for a completed request, its latencies and sizes."""
        if state is None:
            return
        if state.span is not None:
            span = state.span
            event = {
                **state.finished_event,
                "finish_reason": final.reason,
                "prompt_tokens": final.prompt_tokens,
                "completion_tokens": final.completion_tokens,
                "cached_tokens": final.cached_tokens,
            }
            span.add_event("finished", event)
            attributes: dict[str, Any] = {
                "gen_ai.usage.output_tokens": final.completion_tokens,
                "gen_ai.response.finish_reasons": [final.reason],
                "mlxserve.preemptions": int(event.get("preemptions", 0)),
            }
            if final.drafted_tokens:
                attributes["mlxserve.spec_decode.draft_tokens"] = final.drafted_tokens
                attributes["mlxserve.spec_decode.accepted_tokens"] = final.accepted_tokens
            if final.cached_tokens:
                attributes["gen_ai.usage.cache_read.input_tokens"] = final.cached_tokens
            if state.streaming and final.completion_tokens:
                attributes["gen_ai.response.time_to_first_chunk"] = final.ttft_seconds
            span.set_attributes(attributes)
        m, model = self.metrics, self.model
        if m is None:
            return
        m.requests.labels(model, final.reason).inc()
        if state.adapter:
            m.adapter_requests.labels(model, state.adapter, final.reason).inc()
        if final.drafted_tokens:  # drafts were verified however the request ended
            m.draft_tokens.labels(model).inc(final.drafted_tokens)
            m.accepted_tokens.labels(model).inc(final.accepted_tokens)
        if final.reason not in COMPLETED:
            return
        m.e2e.labels(model).observe(time.monotonic() - state.received_at)
        m.queue_time.labels(model).observe(final.queue_seconds)
        m.prefill_time.labels(model).observe(max(0.0, final.ttft_seconds - final.queue_seconds))
        m.decode_time.labels(model).observe(max(0.0, final.total_seconds - final.ttft_seconds))
        m.request_prompt_tokens.labels(model).observe(final.prompt_tokens)
        m.request_generation_tokens.labels(model).observe(final.completion_tokens)

    def request_ended(
        self, state: RequestTelemetry | None, finished: bool, generated: int = 0
    ) -> None:
        """The RPC is over: finished by the engine (request_finished was called), refused, or
        left by its client (cancelled: recorded here)."""
        if state is None:
            return
        if not finished:
            if state.span is not None:
                state.span.add_event("cancelled_by_client", {"generated": generated})
                state.span.set_attributes(
                    {
                        "gen_ai.usage.output_tokens": generated,
                        "gen_ai.response.finish_reasons": [FinishReason.CANCELLED.value],
                    }
                )
            if self.metrics is not None:
                cancelled = FinishReason.CANCELLED.value
                self.metrics.requests.labels(self.model, cancelled).inc()
                if state.adapter:
                    self.metrics.adapter_requests.labels(self.model, state.adapter, cancelled).inc()
        state.span = None
        if state.ids is not None:
            trace_ids.unregister(state.request_id, linger=not finished)

    # -- hooks: structured output (CompileObserver; from the grammar cache's threads) ------
    def looked_up(self, kind: str, hit: bool) -> None:
        if self.metrics is not None:
            self.metrics.grammar_lookups.labels(self.model, "hit" if hit else "miss").inc()

    def compiled(self, kind: str, seconds: float, refusal: GrammarError | None) -> None:
        if self.metrics is not None:
            self.metrics.grammar_compile.labels(self.model, kind).observe(seconds)

    def format_refused(self, kind: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.format_refusals.labels(self.model, kind, code).inc()

    def rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejections.labels(self.model, reason).inc()
