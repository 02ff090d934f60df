"""What every RPC leaves behind: a SERVER span (traced services) and the grpc_server_* metrics.

One grpc.aio interceptor, outermost, so that it sees each RPC's final status whoever sets it
(authentication, request decoding, the servicer) and how long it took. The span continues the
caller's W3C trace context (`traceparent` / `tracestate` metadata, through the global
propagator) and follows the current RPC semantic conventions: named `package.Service/Method`,
`rpc.system.name`, `rpc.method`, `rpc.status_code` (the code's name), `network.peer.*`, and
`error.type` with an error status only for the codes that mean the server failed (UNKNOWN,
DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS). A client error
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) leaves the status unset and records no exception;
a client that cancels gives `rpc.status_code` CANCELLED. The servicer adds the request's
attributes (GenAI conventions) to the span while it is current.

Written here rather than taken from opentelemetry-instrumentation-grpc: its grpc.aio interceptor
emits the deprecated keys (`net.peer.*`, an integer `rpc.grpc.status_code`), records each client
error's abort as an exception (stack traces), misses `abort_with_status` and records a cancelled
call as OK, with no option to do otherwise; and the gRPC metrics need the same wrapping anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc import StatusCode

from service.frontend.telemetry.metrics import Metrics

# The codes a server span reports as errors (gRPC semantic conventions, server side).
SERVER_ERROR_CODES = frozenset(
    {
        StatusCode.UNKNOWN,
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.UNIMPLEMENTED,
        StatusCode.INTERNAL,
        StatusCode.UNAVAILABLE,
        StatusCode.DATA_LOSS,
    }
)


# A client whose deadline passes cancels the call itself, before the server's copy of the
# deadline (counted from the call's arrival, so later by the transit time) runs out: a
# cancellation this close to the deadline is the deadline's.
DEADLINE_SLACK_S = 0.5


def _peer_attributes(peer: str) -> dict[str, Any]:
    """network.* attributes from grpc's peer string: ipv4:1.2.3.4:5, ipv6:[::1]:5, unix:/p."""
    kind, _, address = peer.partition(":")
    if kind == "unix":
        return {"network.transport": "unix", "network.peer.address": address}
    if kind not in ("ipv4", "ipv6"):
        return {}
    host, _, port = address.rpartition(":")
    attributes: dict[str, Any] = {
        "network.transport": "tcp",
        "network.type": kind,
        "network.peer.address": host.strip("[]").replace("%25", "%"),
    }
    if port.isdigit():
        attributes["network.peer.port"] = int(port)
    return attributes


def _carrier(metadata: Sequence[Any] | None) -> dict[str, str]:
    return {k: v for k, v in metadata or () if isinstance(v, str)}


class _Call:
    """One RPC under observation."""

    __slots__ = ("labels", "metrics", "received", "sent", "span", "started", "task", "token")

    def __init__(
        self, metrics: Metrics | None, labels: tuple[str, str, str], span: Any, token: Any
    ) -> None:
        self.metrics = metrics
        self.labels = labels
        self.span = span
        self.token = token  # the OpenTelemetry context token to detach at the end
        self.task = asyncio.current_task()  # the RPC's, whose context the token belongs to
        self.started = time.perf_counter()
        self.received = 0
        self.sent = 0
        if metrics is not None:
            metrics.rpc_started.labels(*labels).inc()

    def end(self, context: Any, error: BaseException | None) -> None:
        code = _status_code(context, error)
        if self.metrics is not None:
            m, labels = self.metrics, self.labels
            m.rpc_handled.labels(*labels, code.name).inc()
            m.rpc_seconds.labels(*labels).observe(time.perf_counter() - self.started)
            if self.received:
                m.rpc_received.labels(*labels).inc(self.received)
            if self.sent:
                m.rpc_sent.labels(*labels).inc(self.sent)
        if self.span is not None:
            _end_span(self.span, code, context, error)
            # A stream left unfinished is closed later by the event loop's generator finalizer,
            # in another task: the RPC's own context is gone then, nothing to detach from.
            if asyncio.current_task() is self.task:
                from opentelemetry import context as otel_context

                otel_context.detach(self.token)


def _status_code(context: Any, error: BaseException | None) -> StatusCode:
    code = context.code()
    if isinstance(code, StatusCode):
        return code  # set by an abort (or by the handler)
    if error is None:
        return StatusCode.OK
    if isinstance(error, BaseException) and not isinstance(error, Exception):
        # asyncio.CancelledError: the client cancelled, its deadline passed, or the server
        # stopped under the call.
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return StatusCode.DEADLINE_EXCEEDED
        return StatusCode.CANCELLED
    return StatusCode.UNKNOWN  # an exception out of the handler: grpc answers UNKNOWN


def _end_span(span: Any, code: StatusCode, context: Any, error: BaseException | None) -> None:
    from opentelemetry.trace import Status
    from opentelemetry.trace import StatusCode as SpanStatus

    span.set_attribute("rpc.status_code", code.name)
    if code in SERVER_ERROR_CODES:
        span.set_attribute("error.type", code.name)
        span.set_status(Status(SpanStatus.ERROR, context.details() or code.name))
        if code is StatusCode.UNKNOWN and isinstance(error, Exception):
            span.record_exception(error)  # a server fault: its stack trace is the lead
    span.end()


class RpcObserver(grpc.aio.ServerInterceptor):
    """Spans for the RPCs of `traced_service` (when `tracer` is set) and gRPC metrics for every
    RPC (when `metrics` is set)."""

    def __init__(self, tracer: Any | None, traced_service: str, metrics: Metrics | None) -> None:
        self._tracer = tracer
        self._traced_service = traced_service
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler  # unknown method: grpc answers UNIMPLEMENTED itself
        service, _, method = details.method.lstrip("/").partition("/")
        traced = self._tracer is not None and service == self._traced_service
        if not traced and self._metrics is None:
            return handler
        kind = {
            (False, False): "unary",
            (False, True): "server_stream",
            (True, False): "client_stream",
            (True, True): "bidi_stream",
        }[(handler.request_streaming, handler.response_streaming)]
        labels = (kind, service, method)
        rpc_name = f"{service}/{method}"

        def begin(context: Any) -> _Call:
            span = token = None
            if traced:
                span, token = self._start_span(rpc_name, context)
            return _Call(self._metrics, labels, span, token)

        return _wrap(handler, begin)

    def _start_span(self, rpc_name: str, context: Any) -> tuple[Any, Any]:
        from opentelemetry import context as otel_context
        from opentelemetry import propagate, trace

        parent = propagate.extract(_carrier(context.invocation_metadata()))
        attributes = {"rpc.system.name": "grpc", "rpc.method": rpc_name}
        attributes.update(_peer_attributes(context.peer() or ""))
        assert self._tracer is not None
        span = self._tracer.start_span(
            rpc_name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return span, token


def _wrap(handler: grpc.RpcMethodHandler, begin: Callable[[Any], _Call]) -> Any:
    """The same handler, each call observed from its start to its status."""

    async def count_requests(requests: AsyncIterator[Any], call: _Call) -> AsyncIterator[Any]:
        async for request in requests:
            call.received += 1
            yield request

    if not handler.response_streaming:
        inner = handler.stream_unary if handler.request_streaming else handler.unary_unary

        async def unary_response(request: Any, context: Any) -> Any:
            call = begin(context)
            if handler.request_streaming:
                request = count_requests(request, call)
            else:
                call.received = 1
            try:
                response = await inner(request, context)
            except BaseException as exc:
                call.end(context, exc)
                raise
            call.sent = 1
            call.end(context, None)
            return response

        factory = (
            grpc.stream_unary_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return factory(unary_response, handler.request_deserializer, handler.response_serializer)

    inner_stream = handler.stream_stream if handler.request_streaming else handler.unary_stream
    if inspect.isasyncgenfunction(inner_stream):

        async def streamed(request: Any, context: Any) -> AsyncIterator[Any]:
            call = begin(context)
            if handler.request_streaming:
                request = count_requests(request, call)
            else:
                call.received = 1
            try:
                # Closed before the span ends, whatever ends the call: the handler's own
                # cleanup (which records how the request ended) runs first.
                async with contextlib.aclosing(inner_stream(request, context)) as responses:
                    async for response in responses:
                        call.sent += 1
                        yield response
            except BaseException as exc:
                call.end(context, exc)
                raise
            call.end(context, None)

        behaviour: Any = streamed
    else:  # writes its responses with context.write: messages sent are not counted

        async def written(request: Any, context: Any) -> Any:
            call = begin(context)
            if handler.request_streaming:
                request = count_requests(request, call)
            else:
                call.received = 1
            try:
                result = await inner_stream(request, context)
            except BaseException as exc:
                call.end(context, exc)
                raise
            call.end(context, None)
            return result

        behaviour = written
    factory = (
        grpc.stream_stream_rpc_method_handler
        if handler.request_streaming
        else grpc.unary_stream_rpc_method_handler
    )
    return factory(behaviour, handler.request_deserializer, handler.response_serializer)
