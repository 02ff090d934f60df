"""Observability end to end (SPEC §6): a real server exports spans over OTLP/gRPC to a receiver
in this process, serves Prometheus metrics over HTTP, and logs JSON lines carrying trace ids."""

from __future__ import annotations

import secrets
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from conftest import ServerProcess, chat_request, free_port, start_server, to_stream
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from client import GenerationClient
from client.cli import main as cli_main
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.model

SERVICE = "mlxserve.v1.GenerationService"
# A marker that must never reach the logs at INFO (no prompt text).
SECRET_PROMPT = "Name one colour. zebra-quartz-7731"
FAULT_MARKER = "tel-fault"  # requests whose id contains it fail in the engine (test hook)
LIFECYCLE = ("queued", "admitted", "prefill_chunk", "first_token", "finished")


# -- the OTLP receiver ---------------------------------------------------------------------------


def _value(any_value: Any) -> Any:
    return (
        getattr(any_value, any_value.WhichOneof("value")) if any_value.WhichOneof("value") else None
    )


def _attrs(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP TraceService: keeps every exported span with its resource attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], trace_pb2.Span]] = []
        self._cond = threading.Condition()

    def Export(self, request: Any, context: Any) -> Any:
        with self._cond:
            for resource_spans in request.resource_spans:
                resource = _attrs(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_span(
        self, predicate: Callable[[trace_pb2.Span], bool], timeout: float = 10.0
    ) -> tuple[dict[str, Any], trace_pb2.Span]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for resource, span in self.spans:
                    if predicate(span):
                        return resource, span
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [s.name for _, s in self.spans]
                    raise AssertionError(f"no matching span within {timeout} s; got {names}")
                self._cond.wait(left)

    def span_of_trace(self, trace_id: str, timeout: float = 10.0) -> trace_pb2.Span:
        return self.wait_span(lambda s: s.trace_id.hex() == trace_id, timeout)[1]


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(0)


@pytest.fixture(scope="module")
def traced(receiver: tuple[Receiver, int]) -> Iterator[tuple[ServerProcess, Receiver, str]]:
    """A real server with tracing to the receiver and metrics on a free port."""
    rec, port = receiver
    metrics_port = free_port()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "MLXSERVE_INJECT_FAULT": FAULT_MARKER,
    }
    flags = ("--max-batch-size", "4", "--log-format", "json", "--metrics-port", str(metrics_port))
    server = start_server(*flags, env=env)
    try:
        yield server, rec, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        server.stop()


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def events(span: trace_pb2.Span) -> list[tuple[str, dict[str, Any]]]:
    ordered = sorted(span.events, key=lambda e: e.time_unix_nano)
    return [(e.name, _attrs(e.attributes)) for e in ordered]


def assert_lifecycle(span: trace_pb2.Span, finish_reason: str, completion_tokens: int) -> None:
    names = [name for name, _ in events(span)]
    for name in LIFECYCLE:
        assert name in names, names
    # In time order: queued, admitted, the prefill chunk(s), the first token, finished.
    firsts = [names.index(name) for name in LIFECYCLE]
    assert firsts == sorted(firsts), names
    finished = dict(events(span))["finished"]
    assert finished["finish_reason"] == finish_reason
    assert finished["completion_tokens"] == completion_tokens
    assert finished["prompt_tokens"] > 0
    chunk = dict(events(span))["prefill_chunk"]
    assert chunk["tokens"] > 0 and chunk["context"] > 0


# -- traces ---------------------------------------------------------------------------------------


def test_generate_span_continues_the_callers_trace(traced: Any) -> None:
    server, rec, _ = traced
    traceparent, trace_id, parent_id = new_traceparent()
    request = chat_request(SECRET_PROMPT, max_tokens=6, request_id="tel-unary")
    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.GenerationServiceStub(channel).Generate(
            request, metadata=[("traceparent", traceparent)], timeout=60
        )
    assert response.usage.completion_tokens == 6

    resource, span = rec.wait_span(lambda s: s.trace_id.hex() == trace_id)
    assert span.parent_span_id.hex() == parent_id
    assert span.name == f"{SERVICE}/Generate"
    assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert resource["service.name"] == "mlxserve"
    attrs = _attrs(span.attributes)
    assert attrs["mlxserve.request_id"] == "tel-unary"
    assert attrs["mlxserve.max_tokens"] == 6
    assert attrs["mlxserve.prompt_tokens"] == response.usage.prompt_tokens
    assert attrs["mlxserve.finish_reason"] == "length"
    assert span.status.code != trace_pb2.Status.STATUS_CODE_ERROR
    assert_lifecycle(span, "length", 6)

    # Every log line of the request carries its request id and the span's ids; no prompt text.
    span_id = span.span_id.hex()
    server.finished_record("tel-unary")
    lines = [r for r in server.records() if r.get("request_id") == "tel-unary"]
    assert {r["event"] for r in lines} >= {"request queued", "request finished"}
    for record in lines:
        assert (record.get("trace_id"), record.get("span_id")) == (trace_id, span_id), record
    assert not [line for line in server.lines if "zebra-quartz" in line]


def test_stream_span_and_cancellation(traced: Any) -> None:
    server, rec, _ = traced
    traceparent, trace_id, parent_id = new_traceparent()
    request = to_stream(chat_request("Count to five.", max_tokens=5, request_id="tel-stream"))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        messages = list(stub.StreamGenerate(request, metadata=[("traceparent", traceparent)]))
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        span = rec.span_of_trace(trace_id)
        assert span.name == f"{SERVICE}/StreamGenerate"
        assert span.parent_span_id.hex() == parent_id
        assert_lifecycle(span, "length", 5)

        # A stream the client leaves early: its span says so and ends without an error status.
        traceparent, trace_id, _ = new_traceparent()
        request = to_stream(chat_request("Tell a long story.", max_tokens=400))
        call = stub.StreamGenerate(request, metadata=[("traceparent", traceparent)])
        next(call), next(call)
        call.cancel()
        span = rec.span_of_trace(trace_id)
        names = [name for name, _ in events(span)]
        assert "cancelled_by_client" in names and "first_token" in names, names


def test_span_status_follows_the_grpc_status(traced: Any) -> None:
    server, rec, _ = traced
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        # A client error: the status code is recorded, the server span is not an error.
        traceparent, trace_id, _ = new_traceparent()
        bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1.0))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(bad, metadata=[("traceparent", traceparent)], timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        span = rec.span_of_trace(trace_id)
        assert _attrs(span.attributes)["rpc.grpc.status_code"] == 3
        assert span.status.code != trace_pb2.Status.STATUS_CODE_ERROR

        # An engine failure (injected for this request id): INTERNAL, an error span.
        traceparent, trace_id, _ = new_traceparent()
        failing = chat_request("Hi", max_tokens=4, request_id=f"{FAULT_MARKER}-1")
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(failing, metadata=[("traceparent", traceparent)], timeout=30)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        span = rec.span_of_trace(trace_id)
        assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
        assert dict(events(span))["finished"]["finish_reason"] == "error"


def test_client_library_and_cli_propagate_trace_context(
    traced: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    server, rec, _ = traced
    # The library: a call inside the caller's active span continues that span's trace.
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller") as caller, GenerationClient(server.target) as c:
        c.generate("Hi", max_tokens=2, timeout=60)
        ctx = caller.get_span_context()
    span = rec.span_of_trace(f"{ctx.trace_id:032x}")
    assert span.parent_span_id.hex() == f"{ctx.span_id:016x}"

    # The CLI: --traceparent.
    traceparent, trace_id, parent_id = new_traceparent()
    args = ["--target", server.target, "generate", "Hi", "--max-tokens", "2"]
    code = cli_main([*args, "--traceparent", traceparent])
    assert code == 0, capsys.readouterr().err
    assert rec.span_of_trace(trace_id).parent_span_id.hex() == parent_id


# -- metrics --------------------------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_move_as_requests_run(traced: Any) -> None:
    server, _, url = traced
    before = scrape(url)
    for name in (
        "mlxserve_queue_depth",
        "mlxserve_active_sequences",
        "mlxserve_kv_blocks_in_use",
        "mlxserve_prefix_cache_hit_ratio",
        "mlxserve_preemptions_total",
    ):
        assert (name, ()) in before, name

    with GenerationClient(server.target) as client:
        tokens = sum(
            client.generate(f"Say {word}.", max_tokens=4, timeout=60).usage.completion_tokens
            for word in ("yes", "no")
        )
        with pytest.raises(grpc.RpcError):
            client.generate(pb.GenerateRequest(), timeout=30)  # no input: INVALID_ARGUMENT
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert tokens == 8
    assert delta("mlxserve_generated_tokens_total") == 8
    assert delta("mlxserve_requests_total", finish_reason="length") == 2
    assert delta("mlxserve_time_to_first_token_seconds_count") == 2
    assert delta("mlxserve_inter_token_latency_seconds_count") == 6  # 3 gaps per request
    assert delta("mlxserve_rejections_total", reason="invalid_argument") == 1
    assert after[("mlxserve_active_sequences", ())] == 0
    assert after[("mlxserve_queue_depth", ())] == 0


# -- units ----------------------------------------------------------------------------------------


def test_tracing_is_on_only_when_an_otlp_export_is_configured() -> None:
    from service.telemetry.tracing import tracing_requested

    endpoint = "http://collector:4317"
    assert not tracing_requested({})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint})
    assert tracing_requested({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing_requested(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    )
    assert not tracing_requested({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})


def test_client_injects_the_active_span_unless_a_traceparent_is_given() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from client.client import with_trace_context

    assert with_trace_context(None) is None  # no active span: nothing to send
    explicit = [("traceparent", new_traceparent()[0])]
    with TracerProvider().get_tracer("test").start_as_current_span("caller") as span:
        injected = dict(with_trace_context([("x-tenant", "a")]) or [])
        assert with_trace_context(explicit) == explicit
    ctx = span.get_span_context()
    assert injected["x-tenant"] == "a"
    assert injected["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
