"""Prometheus metrics on their own registry, served on --metrics-port at /metrics (front end 0).

- Per request (`mlxserve_*`, label `model`): token counters, latency and size histograms,
  requests by finish reason, rejections, preemptions and prefix-cache queries and hits, fed by
  the telemetry hooks from the lifecycle events the engine core sends with each request; per
  LoRA adapter (`mlxserve_adapter_*`, labels `model` and `adapter`): requests by finish reason
  and generated tokens.
- The engine core's state (`mlxserve_num_requests_*`, `mlxserve_kv_cache_*`): gauges read from
  a CacheStats snapshot at scrape time, so they cost nothing between scrapes.
- Per RPC (`grpc_server_*`, go-grpc-prometheus's names and labels): started, handled by code,
  handling seconds, messages received and sent, fed by the RpcObserver interceptor.
- Processes: `process_*` (this front end), `mlxserve_core_process_*` (the engine core).
- Structured output (`mlxserve_structured_output_*`, `mlxserve_grammar_*`): requests with a
  response format by kind, refusals, this front end's compiles and cache lookups; and from the
  engine core's snapshot, its compiles and the time spent filling token masks per step and per
  row-step (histograms the core keeps; service.protocol.GrammarCounters).

With several front ends (--api-workers) each keeps its counters and histograms in the
directory named by PROMETHEUS_MULTIPROC_DIR (the launcher sets it before any of them imports
prometheus_client), and front end 0's /metrics adds them up (prometheus-client's multiprocess
mode).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import structlog
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from service.protocol import FORMAT_KINDS, MASK_SECONDS_BUCKETS, GrammarCounters

log = structlog.get_logger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FINISH_REASONS = ("stop", "length", "cancelled", "error")
REJECTION_REASONS = (
    "queue_full",
    "kv_budget",
    "invalid_argument",
    "already_exists",
    "unavailable",
    "adapter_not_found",
)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# Queue, prefill, decode and end-to-end times: from a few ms (an idle server's queue) to
# minutes (a long generation on a CPU).
REQUEST_SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
    300.0, 600.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
RPC_SECONDS_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
COMPILE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _CacheStatsCollector(Collector):
    """Gauges from one CacheStatsResponse of the engine core, taken when Prometheus scrapes."""

    def __init__(self, cache_stats: Callable[[], Any], model: Callable[[], str]) -> None:
        self._cache_stats = cache_stats
        self._model = model

    def describe(self) -> list:
        return []  # unchecked collector: no call of cache_stats() at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            s = self._cache_stats()
        except Exception:  # the core is still loading, or did not answer in time
            log.debug("cache stats unavailable for /metrics", exc_info=True)
            return
        model = self._model()

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=["model"])
            family.add_metric([model], value)
            return family

        paged = s.storage_backend == "paged"
        yield gauge(
            "mlxserve_num_requests_running",
            "Requests holding a batch slot (prefilling or decoding).",
            s.active_sequences,
        )
        yield gauge(
            "mlxserve_num_requests_waiting",
            "Requests queued for admission (preempted ones included).",
            s.queued_requests,
        )
        if paged:
            usage = s.active_blocks / s.total_blocks if s.total_blocks else 0.0
        else:
            usage = s.used_bytes / s.capacity_bytes if s.capacity_bytes else 0.0
        yield gauge(
            "mlxserve_kv_cache_usage_ratio",
            "Fraction of the KV cache held by running requests (0 to 1); cached prefixes of "
            "finished requests count as free.",
            usage,
        )
        yield gauge(
            "mlxserve_kv_cache_capacity_blocks",
            "KV cache blocks the budget holds (paged storage; 0 for dense).",
            s.total_blocks if paged else 0,
        )
        yield gauge(
            "mlxserve_kv_cache_capacity_bytes",
            "Bytes of K/V the cache can hold (0 when unknown).",
            s.capacity_bytes,
        )
        yield gauge(
            "mlxserve_kv_cache_used_blocks",
            "KV cache blocks held by running requests (paged storage; 0 for dense).",
            s.active_blocks if paged else 0,
        )
        yield gauge(
            "mlxserve_kv_cache_used_bytes",
            "Bytes of K/V holding running requests' tokens.",
            s.used_bytes,
        )
        steps = CounterMetricFamily(
            "mlxserve_core_steps",
            "Engine steps, by pipeline: overlapped (planned and built while the step before ran) "
            "or serial (after it was read: admissions, prefills, preemptions, verifications "
            "and cancellations wait for it).",
            labels=["model", "pipeline"],
        )
        steps.add_metric([model, "overlapped"], s.steps.overlapped)
        steps.add_metric([model, "serial"], s.steps.serial)
        yield steps
        yield from _grammar_families(s.grammar, model)


def _grammar_families(g: GrammarCounters, model: str) -> Iterator[Any]:
    """The engine core's structured-output counters and mask-time histograms."""
    for name, documentation, value in (
        (
            "mlxserve_core_grammar_compiles",
            "Response formats the engine core compiled (cache misses; refusals included).",
            g.compiles,
        ),
        (
            "mlxserve_core_grammar_cache_hits",
            "Response formats the engine core found compiled (or compiling) already.",
            g.cache_hits,
        ),
        (
            "mlxserve_core_grammar_refusals",
            "Response formats the engine core's grammar engine refused.",
            g.refusals,
        ),
    ):
        counter = CounterMetricFamily(name, documentation, labels=["model"])
        counter.add_metric([model], value)
        yield counter
    for name, documentation, counts in (
        (
            "mlxserve_grammar_mask_seconds",
            "Wall time of filling one step's token masks (all its constrained rows at once, "
            "on the grammar engine's threads, while the step's forward runs).",
            g.mask_step_buckets,
        ),
        (
            "mlxserve_grammar_mask_row_seconds",
            "A constrained row's share of its step's mask time (per row-step).",
            g.mask_row_buckets,
        ),
    ):
        if not counts:
            continue
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, MASK_SECONDS_BUCKETS), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family = HistogramMetricFamily(name, documentation, labels=["model"])
        family.add_metric([model], buckets, g.mask_seconds)
        yield family


class Metrics:
    """Every metric of a front end. Observations take the served model's name as their `model`
    label (empty until the engine core reports the model loaded)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` series: they only add noise to a scrape
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        if self.multiprocess and values.ValueClass is values.MutexValue:
            raise RuntimeError(
                f"{MULTIPROC_ENV} was set after prometheus_client was imported in this process"
            )
        self.model = ""
        self.registry = CollectorRegistry(auto_describe=True)
        self._request_counters(self.registry)
        self._latencies(self.registry)
        self._grpc(self.registry)
        self._structured_output(self.registry)
        self._server: Any = None

    def _request_counters(self, r: CollectorRegistry) -> None:
        m = ["model"]
        self.prompt_tokens = Counter(
            "mlxserve_prompt_tokens",
            "Prompt tokens of requests that began to generate.",
            m,
            registry=r,
        )
        self.generation_tokens = Counter(
            "mlxserve_generation_tokens", "Generated tokens delivered to their RPC.", m, registry=r
        )
        self.requests = Counter(
            "mlxserve_requests",
            "Requests that ran, by finish reason (cancelled: the client left, its deadline "
            "passed or the server stopped it).",
            [*m, "finish_reason"],
            registry=r,
        )
        self.rejections = Counter(
            "mlxserve_rejections",
            "Requests refused before they ran, by reason.",
            [*m, "reason"],
            registry=r,
        )
        self.preemptions = Counter(
            "mlxserve_preemptions",
            "Running requests evicted (for a higher priority or for KV blocks).",
            m,
            registry=r,
        )
        self.draft_tokens = Counter(
            "mlxserve_spec_decode_draft_tokens",
            "Prompt-lookup tokens proposed for verification (--draft-kind prompt-lookup).",
            m,
            registry=r,
        )
        self.accepted_tokens = Counter(
            "mlxserve_spec_decode_accepted_tokens",
            "Proposed tokens the model accepted; over draft tokens, the acceptance rate.",
            m,
            registry=r,
        )
        self.prefix_queries = Counter(
            "mlxserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission (paged storage).",
            m,
            registry=r,
        )
        self.prefix_hits = Counter(
            "mlxserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache at admission (not prefilled again).",
            m,
            registry=r,
        )
        # Per LoRA adapter (requests that named one; the others are the base model's).
        self.adapter_requests = Counter(
            "mlxserve_adapter_requests",
            "Requests that named a LoRA adapter, by adapter and finish reason.",
            [*m, "adapter", "finish_reason"],
            registry=r,
        )
        self.adapter_generation_tokens = Counter(
            "mlxserve_adapter_generation_tokens",
            "Tokens generated for requests that named a LoRA adapter, by adapter.",
            [*m, "adapter"],
            registry=r,
        )

    def _latencies(self, r: CollectorRegistry) -> None:
        m = ["model"]
        self.ttft = Histogram(
            "mlxserve_time_to_first_token_seconds",
            "Arrival in the engine to the first generated token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mlxserve_inter_token_latency_seconds",
            "Time between consecutive tokens of a request, as delivered to its RPC.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )

        def seconds(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, m, buckets=REQUEST_SECONDS_BUCKETS, registry=r)

        def tokens(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, m, buckets=TOKEN_COUNT_BUCKETS, registry=r)

        # Of requests that finished with stop or length.
        self.e2e = seconds(
            "mlxserve_e2e_request_latency_seconds",
            "The RPC's arrival to the request's last token (stop or length).",
        )
        self.queue_time = seconds(
            "mlxserve_request_queue_time_seconds", "Arrival in the engine to first admission."
        )
        self.prefill_time = seconds(
            "mlxserve_request_prefill_time_seconds", "First admission to the first token."
        )
        self.decode_time = seconds(
            "mlxserve_request_decode_time_seconds", "First token to the last token."
        )
        self.request_prompt_tokens = tokens(
            "mlxserve_request_prompt_tokens", "Prompt tokens of a finished request."
        )
        self.request_generation_tokens = tokens(
            "mlxserve_request_generation_tokens", "Generated tokens of a finished request."
        )

    def _grpc(self, r: CollectorRegistry) -> None:
        """gRPC server metrics, named as go-grpc-prometheus and py-grpc-prometheus name them."""
        self.rpc_started = Counter(
            "grpc_server_started", "RPCs started on the server.", GRPC_LABELS, registry=r
        )
        self.rpc_handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            [*GRPC_LABELS, "grpc_code"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from an RPC's start to its status.",
            GRPC_LABELS,
            buckets=RPC_SECONDS_BUCKETS,
            registry=r,
        )
        self.rpc_received = Counter(
            "grpc_server_msg_received", "Request messages received.", GRPC_LABELS, registry=r
        )
        self.rpc_sent = Counter(
            "grpc_server_msg_sent", "Response messages sent.", GRPC_LABELS, registry=r
        )

    def _structured_output(self, r: CollectorRegistry) -> None:
        """Response formats as this front end sees them (the engine core's are scraped from
        its stats: service.protocol.GrammarCounters)."""
        m = ["model"]
        self.structured_requests = Counter(
            "mlxserve_structured_output_requests",
            "Requests with a response format, by kind, as they were queued.",
            [*m, "kind"],
            registry=r,
        )
        self.format_refusals = Counter(
            "mlxserve_structured_output_refusals",
            "Response formats refused (INVALID_ARGUMENT), by kind and the engine's code: "
            "invalid, unsupported, too_complex, timeout.",
            [*m, "kind", "code"],
            registry=r,
        )
        self.grammar_compile = Histogram(
            "mlxserve_grammar_compile_seconds",
            "Compiling a response format on a front end (cache misses; refusals included).",
            [*m, "kind"],
            buckets=COMPILE_SECONDS_BUCKETS,
            registry=r,
        )
        self.grammar_lookups = Counter(
            "mlxserve_grammar_cache_lookups",
            "A front end's lookups of compiled response formats, by result: hit (compiled or "
            "compiling already) or miss.",
            [*m, "result"],
            registry=r,
        )

    def set_model(self, model: str) -> None:
        """The served model is known: export zeros for its finish reasons and rejections, so
        that rate() works from the first request."""
        self.model = model
        for reason in FINISH_REASONS:
            self.requests.labels(model, reason)
        for reason in REJECTION_REASONS:
            self.rejections.labels(model, reason)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.draft_tokens,
            self.accepted_tokens,
        ):
            metric.labels(model)
        for metric in (self.prefix_queries, self.prefix_hits):
            metric.labels(model)
        for kind in FORMAT_KINDS:
            self.structured_requests.labels(model, kind)
        for result in ("hit", "miss"):
            self.grammar_lookups.labels(model, result)

    def serve(
        self, host: str, port: int, cache_stats: Callable[[], Any], core_pid: int | None
    ) -> None:
        """Serve /metrics over HTTP from a daemon thread: this process's metrics (or every
        front end's, in multiprocess mode), the core's gauges (`cache_stats()` at each
        scrape), and both processes' resource use."""
        registry = self.registry
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
        registry.register(_CacheStatsCollector(cache_stats, lambda: self.model))
        if core_pid:
            ProcessCollector(namespace="mlxserve_core", pid=lambda: core_pid, registry=registry)
        self._server, _ = start_http_server(port, addr=host, registry=registry)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
