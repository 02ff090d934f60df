"""Observability end to end (README, "Observability"): a real server exports spans over
OTLP/gRPC to a receiver in this process, serves Prometheus metrics over HTTP (scraped by a real
Prometheus too), and logs JSON lines carrying trace ids."""

from __future__ import annotations

import json
import math
import secrets
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from client import GenerationClient
from client.cli import main as cli_main
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.metrics import EMBEDDED_MODEL_ID, MetricSamples, metric, scrape_metrics
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import ServerProcess, free_port, start_server, wait_until

pytestmark = pytest.mark.model

SERVICE = "mlxserve.v1.GenerationService"
# A marker that must never reach the logs at INFO (no prompt text).
SECRET_PROMPT = "Name one colour. zebra-quartz-7731"
FAULT_MARKER = "tel-fault"  # requests whose id contains it fail in the engine (test hook)
LIFECYCLE = ("queued", "admitted", "prefill_chunk", "first_token", "finished")
MODEL = EMBEDDED_MODEL_ID


# -- the OTLP receiver ---------------------------------------------------------------------------


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


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


def assert_rpc_attributes(span: trace_pb2.Span, method: str, status_code: str) -> None:
    """The RPC semantic conventions' current keys, none of the deprecated ones."""
    attrs = _attrs(span.attributes)
    assert span.name == f"{SERVICE}/{method}"
    assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert attrs["rpc.system.name"] == "grpc"
    assert attrs["rpc.method"] == f"{SERVICE}/{method}"
    assert attrs["rpc.status_code"] == status_code
    assert attrs["network.peer.address"] == "127.0.0.1"
    assert isinstance(attrs["network.peer.port"], int) and attrs["network.peer.port"] > 0
    assert attrs["network.type"] == "ipv4"
    deprecated = ("net.", "rpc.grpc.status_code", "rpc.service", "rpc.system")
    assert not [k for k in attrs if k.startswith(deprecated) and k != "rpc.system.name"], attrs


def exception_events(span: trace_pb2.Span) -> list[str]:
    return [e.name for e in span.events if e.name == "exception"]


@pytest.mark.slow
def test_generate_span_continues_the_callers_trace(traced: Any) -> None:
    server, rec, _ = traced
    traceparent, trace_id, parent_id = new_traceparent()
    request = chat_request(
        SECRET_PROMPT,
        max_tokens=6,
        request_id="tel-unary",
        sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=11),
    )
    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.GenerationServiceStub(channel).Generate(
            request, metadata=[("traceparent", traceparent)], timeout=60
        )
    assert response.usage.completion_tokens == 6

    resource, span = rec.wait_span(lambda s: s.trace_id.hex() == trace_id)
    assert span.parent_span_id.hex() == parent_id
    assert resource["service.name"] == "mlxserve"
    assert_rpc_attributes(span, "Generate", "OK")
    attrs = _attrs(span.attributes)
    # The OpenTelemetry GenAI conventions, beside the RPC ones.
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "mlxserve"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == MODEL
    assert attrs["gen_ai.request.stream"] is False
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.request.top_k"] == 40.0
    assert attrs["gen_ai.request.seed"] == 11
    assert attrs["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == 6
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.response.id"] == attrs["mlxserve.request_id"] == "tel-unary"
    assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET
    assert_lifecycle(span, "length", 6)

    # Every log line of the request carries its request id and the span's ids; no prompt text.
    span_id = span.span_id.hex()
    server.finished_record("tel-unary")
    lines = [r for r in server.records() if r.get("request_id") == "tel-unary"]
    assert {r["event"] for r in lines} >= {"request queued", "request finished"}
    for record in lines:
        assert (record.get("trace_id"), record.get("span_id")) == (trace_id, span_id), record
    assert not [line for line in server.lines if "zebra-quartz" in line]


def finish_reasons(span: trace_pb2.Span) -> list[str]:
    return _attrs(span.attributes)["gen_ai.response.finish_reasons"]


@pytest.mark.slow
def test_stream_span_and_cancellation(traced: Any) -> None:
    server, rec, _ = traced
    traceparent, trace_id, parent_id = new_traceparent()
    request = to_stream(chat_request("Count to five.", max_tokens=5, request_id="tel-stream"))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        messages = list(stub.StreamGenerate(request, metadata=[("traceparent", traceparent)]))
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        span = rec.span_of_trace(trace_id)
        assert span.parent_span_id.hex() == parent_id
        assert_rpc_attributes(span, "StreamGenerate", "OK")
        attrs = _attrs(span.attributes)
        assert attrs["gen_ai.request.stream"] is True
        assert attrs["gen_ai.response.time_to_first_chunk"] > 0
        assert_lifecycle(span, "length", 5)

        # A stream the client leaves early: recorded as CANCELLED, not as an error.
        traceparent, trace_id, _ = new_traceparent()
        request = to_stream(chat_request("Tell a long story.", max_tokens=400))
        call = stub.StreamGenerate(request, metadata=[("traceparent", traceparent)])
        next(call), next(call)
        call.cancel()
        span = rec.span_of_trace(trace_id)
        names = [name for name, _ in events(span)]
        assert "cancelled_by_client" in names and "first_token" in names, names
        assert_rpc_attributes(span, "StreamGenerate", "CANCELLED")
        assert finish_reasons(span) == ["cancelled"]
        assert _attrs(span.attributes)["gen_ai.usage.output_tokens"] >= 2
        assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET
        assert not exception_events(span)


@pytest.mark.slow
def test_a_stop_string_and_raw_text_on_the_span(traced: Any) -> None:
    """A stop string ends the request on the front end (the core only sees an abort): the span
    still says stop. Raw text input is a text_completion."""
    server, rec, _ = traced
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(
            text="1, 2, 3, 4,", stopping=pb.StoppingCriteria(max_tokens=20)
        )
        free = stub.Generate(request, timeout=60)
        stop = free.text.strip()[:2]  # something it is sure to generate again
        assert stop
        traceparent, trace_id, _ = new_traceparent()
        request.stopping.stop.append(stop)
        stopped = stub.Generate(request, metadata=[("traceparent", traceparent)], timeout=60)
    assert stopped.finish_reason == pb.FINISH_REASON_STOP and stopped.stop_string == stop
    span = rec.span_of_trace(trace_id)
    attrs = _attrs(span.attributes)
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.stop_sequences"] == [stop]
    assert finish_reasons(span) == ["stop"]
    assert dict(events(span))["finished"]["finish_reason"] == "stop"


@pytest.mark.slow
def test_span_status_follows_the_grpc_status(traced: Any) -> None:
    server, rec, _ = traced
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        # A client error: the status code is recorded, the span is not an error and carries
        # no stack trace.
        traceparent, trace_id, _ = new_traceparent()
        bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1.0))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(bad, metadata=[("traceparent", traceparent)], timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        span = rec.span_of_trace(trace_id)
        assert_rpc_attributes(span, "Generate", "INVALID_ARGUMENT")
        assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET
        assert "error.type" not in _attrs(span.attributes)
        assert _attrs(span.attributes)["gen_ai.operation.name"] == "text_completion"
        assert not exception_events(span)

        # An engine failure (injected for this request id): INTERNAL, an error span, still no
        # stack trace (the server's log has the failure).
        traceparent, trace_id, _ = new_traceparent()
        failing = chat_request("Hi", max_tokens=4, request_id=f"{FAULT_MARKER}-1")
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(failing, metadata=[("traceparent", traceparent)], timeout=30)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        span = rec.span_of_trace(trace_id)
        assert_rpc_attributes(span, "Generate", "INTERNAL")
        assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
        assert _attrs(span.attributes)["error.type"] == "INTERNAL"
        assert finish_reasons(span) == ["error"]
        assert dict(events(span))["finished"]["finish_reason"] == "error"
        assert not exception_events(span)

        # A deadline that passes while the request runs: DEADLINE_EXCEEDED, an error.
        traceparent, trace_id, _ = new_traceparent()
        slow = chat_request("Tell a long story.", max_tokens=400)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(slow, metadata=[("traceparent", traceparent)], timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        span = rec.span_of_trace(trace_id)
        assert_rpc_attributes(span, "Generate", "DEADLINE_EXCEEDED")
        assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
        assert finish_reasons(span) == ["cancelled"]


@pytest.mark.slow
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


@pytest.mark.slow
def test_metrics_move_as_requests_run(traced: Any) -> None:
    server, _, url = traced
    before = scrape_metrics(url)
    for name in (
        "mlxserve_num_requests_running",
        "mlxserve_num_requests_waiting",
        "mlxserve_kv_cache_usage_ratio",
        "mlxserve_kv_cache_capacity_blocks",
        "mlxserve_kv_cache_capacity_bytes",
        "mlxserve_kv_cache_used_blocks",
        "mlxserve_preemptions_total",
        "mlxserve_prefix_cache_queries_total",
    ):
        assert (name, (("model", MODEL),)) in before, name
    assert metric(before, "mlxserve_kv_cache_capacity_blocks", model=MODEL) > 0
    assert metric(before, "mlxserve_kv_cache_capacity_bytes", model=MODEL) > 0
    for name in ("process_resident_memory_bytes", "mlxserve_core_process_resident_memory_bytes"):
        assert metric(before, name) > 0, name  # both processes' resource use

    # Long enough for two full KV blocks, which the second request finds cached.
    prompt = "Say yes, please, and nothing more than that one word. " * 4
    with GenerationClient(server.target) as client:
        replies = [client.generate(prompt, max_tokens=4, timeout=60) for _ in range(2)]
        with pytest.raises(grpc.RpcError):
            client.generate(pb.GenerateRequest(), timeout=30)  # no input: INVALID_ARGUMENT
    # An aborted call's status reaches the client a moment before its handler returns and the
    # RPC observer counts it, and a scrape can fall between the observer's increments of one call
    # (it reads one metric, then the next): scrape until each of them has counted the third call,
    # as Prometheus would later.
    rpc = {"grpc_service": SERVICE, "grpc_method": "Generate", "grpc_type": "unary"}
    expected = {
        ("grpc_server_handled_total", (("grpc_code", "OK"),)): 2,
        ("grpc_server_handled_total", (("grpc_code", "INVALID_ARGUMENT"),)): 1,
        ("grpc_server_handling_seconds_count", ()): 3,
        ("grpc_server_msg_received_total", ()): 3,
        ("grpc_server_msg_sent_total", ()): 2,
    }
    keys = {
        (name, tuple(sorted({**rpc, **dict(extra)}.items()))): count
        for (name, extra), count in expected.items()
    }

    def all_counted() -> MetricSamples | None:
        samples = scrape_metrics(url)
        done = all(samples.get(k, 0) - before.get(k, 0) >= n for k, n in keys.items())
        return samples if done else None

    after = wait_until(all_counted, "the third Generate call to be counted", 10)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt_tokens = replies[0].usage.prompt_tokens
    assert [r.usage.completion_tokens for r in replies] == [4, 4]
    assert delta("mlxserve_generation_tokens_total", model=MODEL) == 8
    assert delta("mlxserve_prompt_tokens_total", model=MODEL) == 2 * prompt_tokens
    assert delta("mlxserve_requests_total", model=MODEL, finish_reason="length") == 2
    assert delta("mlxserve_rejections_total", model=MODEL, reason="invalid_argument") == 1
    for histogram in (
        "mlxserve_time_to_first_token_seconds",
        "mlxserve_e2e_request_latency_seconds",
        "mlxserve_request_queue_time_seconds",
        "mlxserve_request_prefill_time_seconds",
        "mlxserve_request_decode_time_seconds",
        "mlxserve_request_prompt_tokens",
        "mlxserve_request_generation_tokens",
    ):
        assert delta(f"{histogram}_count", model=MODEL) == 2, histogram
    assert delta("mlxserve_inter_token_latency_seconds_count", model=MODEL) == 6  # 3 gaps each
    assert delta("mlxserve_request_generation_tokens_sum", model=MODEL) == 8
    assert delta("mlxserve_request_prompt_tokens_sum", model=MODEL) == 2 * prompt_tokens
    # The second request found the first one's full prompt blocks in the prefix cache.
    assert delta("mlxserve_prefix_cache_queries_total", model=MODEL) == 2 * prompt_tokens
    assert delta("mlxserve_prefix_cache_hits_total", model=MODEL) == replies[1].usage.cached_tokens
    assert replies[1].usage.cached_tokens > 0
    # gRPC server metrics, by method and code.
    assert delta("grpc_server_started_total", **rpc) == 3
    assert delta("grpc_server_handled_total", **rpc, grpc_code="OK") == 2
    assert delta("grpc_server_handled_total", **rpc, grpc_code="INVALID_ARGUMENT") == 1
    assert delta("grpc_server_handling_seconds_count", **rpc) == 3
    assert delta("grpc_server_msg_received_total", **rpc) == 3
    assert delta("grpc_server_msg_sent_total", **rpc) == 2
    assert metric(after, "mlxserve_num_requests_running", model=MODEL) == 0
    assert metric(after, "mlxserve_num_requests_waiting", model=MODEL) == 0
    assert metric(after, "mlxserve_kv_cache_used_blocks", model=MODEL) == 0
    # Each request's admission is a serial step; its later tokens come from overlapped ones.
    steps = "mlxserve_core_steps_total"
    assert delta(steps, model=MODEL, pipeline="serial") >= 2
    assert delta(steps, model=MODEL, pipeline="overlapped") >= 2


@pytest.mark.slow
def test_a_cancelled_stream_is_counted_as_cancelled(traced: Any) -> None:
    server, _, url = traced
    before = scrape_metrics(url)
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.GenerationServiceStub(channel).StreamGenerate(
            to_stream(chat_request("Tell a long story.", max_tokens=400))
        )
        next(call)
        call.cancel()
    rpc = {"grpc_service": SERVICE, "grpc_method": "StreamGenerate", "grpc_type": "server_stream"}
    cancelled = {**rpc, "grpc_code": "CANCELLED"}

    key = {"model": MODEL, "finish_reason": "cancelled"}

    def counted() -> MetricSamples | None:
        # The status is recorded as the RPC ends; the request's count as its task unwinds.
        samples = scrape_metrics(url)
        handled = metric(samples, "grpc_server_handled_total", **cancelled)
        requests = metric(samples, "mlxserve_requests_total", **key)
        was_handled = metric(before, "grpc_server_handled_total", **cancelled)
        was_requests = metric(before, "mlxserve_requests_total", **key)
        return samples if handled > was_handled and requests > was_requests else None

    after = wait_until(counted, "the cancelled stream to be counted", 10)
    assert metric(after, "mlxserve_requests_total", **key) == (
        metric(before, "mlxserve_requests_total", **key) + 1
    )


@pytest.mark.slow
def test_structured_output_on_the_span_and_in_the_metrics(traced: Any) -> None:
    """The span names the format's kind; the metrics count requests by kind, refusals by
    code, the front end's compiles and cache lookups, and the core's compiles and mask times."""
    server, rec, url = traced
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    request = chat_request(
        "Give me a number as JSON.",
        max_tokens=12,
        response_format=pb.ResponseFormat(json_schema=json.dumps(schema)),
    )
    traceparent, trace_id, _ = new_traceparent()
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        stub.Generate(request, metadata=[("traceparent", traceparent)], timeout=120)
        stub.Generate(request, timeout=120)  # compiled already: a hit
        refused = chat_request("Hi", max_tokens=2, response_format=pb.ResponseFormat(regex="a("))
        with pytest.raises(grpc.RpcError):
            stub.Generate(refused, timeout=60)
    attrs = _attrs(rec.span_of_trace(trace_id).attributes)
    assert attrs["mlxserve.response_format"] == "json_schema"
    assert attrs["gen_ai.output.type"] == "json"
    samples = scrape_metrics(url)
    by_kind = {"model": MODEL, "kind": "json_schema"}
    assert metric(samples, "mlxserve_structured_output_requests_total", **by_kind) >= 2
    assert metric(samples, "mlxserve_grammar_compile_seconds_count", **by_kind) >= 1
    hits = {"model": MODEL, "result": "hit"}
    assert metric(samples, "mlxserve_grammar_cache_lookups_total", **hits) >= 1
    regex = {"model": MODEL, "kind": "regex", "code": "invalid"}
    assert metric(samples, "mlxserve_structured_output_refusals_total", **regex) >= 1
    assert metric(samples, "mlxserve_core_grammar_compiles_total", model=MODEL) >= 1
    assert metric(samples, "mlxserve_core_grammar_cache_hits_total", model=MODEL) >= 1
    steps = metric(samples, "mlxserve_grammar_mask_seconds_count", model=MODEL)
    row_steps = metric(samples, "mlxserve_grammar_mask_row_seconds_count", model=MODEL)
    assert steps > 0 and row_steps >= steps
    assert metric(samples, "mlxserve_grammar_mask_seconds_sum", model=MODEL) > 0
    top = {"model": MODEL, "le": "+Inf"}
    assert metric(samples, "mlxserve_grammar_mask_seconds_bucket", **top) == steps


# -- a real Prometheus --------------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus")


@pytest.fixture
def prometheus(traced: Any, tmp_path: Path) -> Iterator[str]:
    """Debian's Prometheus scraping the traced server's /metrics every second."""
    if PROMETHEUS is None:
        pytest.skip("no `prometheus` binary (Debian's prometheus package; scripts/install.sh)")
    _, _, metrics_url = traced
    target = urllib.parse.urlsplit(metrics_url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: mlxserve\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not start: {proc.stderr.read()}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def promql(base: str, query: str) -> list[dict[str, Any]]:
    """An instant query over Prometheus's HTTP API: its result vector."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as answer:
        body = json.loads(answer.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for_series(base: str, query: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not (result := promql(base, query)):
        assert time.monotonic() < deadline, f"no series for {query!r} within {timeout} s"
        time.sleep(0.5)
    return result


@pytest.mark.slow
def test_prometheus_scrapes_the_server_under_load(traced: Any, prometheus: str) -> None:
    server, _, _ = traced
    wait_for_series(prometheus, 'up{job="mlxserve"} == 1')
    wait_for_series(prometheus, "mlxserve_generation_tokens_total")  # a sample before the load

    def stream(i: int) -> None:
        with GenerationClient(server.target) as client:
            for _ in range(2):
                request = chat_request(f"Tell story number {i}.", max_tokens=16)
                list(client.stream(request, timeout=120))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        rate = wait_for_series(prometheus, "rate(mlxserve_generation_tokens_total[30s]) > 0")
        assert rate[0]["metric"]["model"] == MODEL
        busy = wait_for_series(prometheus, "max_over_time(mlxserve_num_requests_running[30s]) > 0")
        assert float(busy[0]["value"][1]) >= 1
    finally:
        for t in threads:
            t.join(120)
    quantile = (
        "histogram_quantile(0.9, sum by (le) (rate(mlxserve_time_to_first_token_seconds_bucket"
        "[30s])))"
    )
    ttft = wait_for_series(prometheus, quantile)
    assert 0 < float(ttft[0]["value"][1]) < math.inf
    handled = wait_for_series(
        prometheus,
        'sum by (grpc_code) (increase(grpc_server_handled_total{grpc_method="StreamGenerate"}'
        "[30s])) > 0",
    )
    assert {r["metric"]["grpc_code"] for r in handled} >= {"OK"}


# -- units ----------------------------------------------------------------------------------------


def test_tracing_is_on_only_when_an_otlp_export_is_configured() -> None:
    from service.frontend.telemetry.tracing import tracing_requested

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


def test_network_attributes_from_grpc_peer_strings() -> None:
    from service.frontend.telemetry.rpc import _peer_attributes

    assert _peer_attributes("ipv4:10.1.2.80:65123") == {
        "network.transport": "tcp",
        "network.type": "ipv4",
        "network.peer.address": "10.1.2.80",
        "network.peer.port": 65123,
    }
    ipv6 = _peer_attributes("ipv6:[fe80::1%25eth0]:443")
    assert ipv6["network.peer.address"] == "fe80::1%eth0" and ipv6["network.peer.port"] == 443
    assert _peer_attributes("unix:/run/mlxserve.sock") == {
        "network.transport": "unix",
        "network.peer.address": "/run/mlxserve.sock",
    }
    assert _peer_attributes("") == {}


def test_a_request_naming_an_adapter_is_counted_and_traced_by_adapter() -> None:
    from service.frontend.telemetry.metrics import Metrics
    from service.frontend.telemetry.telemetry import Telemetry
    from service.protocol import Final, GenerationRequest

    metrics = Metrics()
    telemetry = Telemetry(metrics=metrics)
    telemetry.model_ready("m")
    request = GenerationRequest("r1", (1, 2, 3), adapter="sql")
    assert telemetry._request_attributes(request)["mlxserve.adapter"] == "sql"
    assert "mlxserve.adapter" not in telemetry._request_attributes(GenerationRequest("r2", (1,)))
    state = telemetry.request_started(request, time.monotonic())
    telemetry.request_tokens(state, 4)
    telemetry.request_finished(state, Final("length", prompt_tokens=3, completion_tokens=4))
    telemetry.request_ended(state, True, 4)
    cancelled = telemetry.request_started(request, time.monotonic())
    telemetry.request_ended(cancelled, False, 0)

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model": "m", **labels}) or 0.0

    assert value("mlxserve_adapter_requests_total", adapter="sql", finish_reason="length") == 1
    assert value("mlxserve_adapter_requests_total", adapter="sql", finish_reason="cancelled") == 1
    assert value("mlxserve_adapter_generation_tokens_total", adapter="sql") == 4
