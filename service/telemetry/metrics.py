"""Prometheus metrics on their own registry, served on --metrics-port at /metrics.

Counters and histograms are fed by the scheduler observer and the servicer's hooks; the gauges
(queue depth, active sequences, KV blocks in use, prefix-cache hit ratio) are read from
Runtime.cache_stats() at scrape time, so they cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = structlog.get_logger(__name__)

FINISH_REASONS = ("stop", "length", "cancelled", "error")
REJECTION_REASONS = ("queue_full", "invalid_argument", "already_exists", "unavailable")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class _CacheStatsCollector(Collector):
    """Gauges from one CacheStatsResponse, taken when Prometheus scrapes."""

    def __init__(self, cache_stats: Callable[[], Any]) -> None:
        self._cache_stats = cache_stats

    def describe(self) -> list:
        return []  # unchecked collector: no call of cache_stats() at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            s = self._cache_stats()
        except Exception:  # the runtime is still loading, or a race with the scheduler thread
            log.debug("cache stats unavailable for /metrics", exc_info=True)
            return
        yield GaugeMetricFamily(
            "mlxserve_queue_depth", "Requests waiting for admission.", value=s.queued_requests
        )
        yield GaugeMetricFamily(
            "mlxserve_active_sequences",
            "Sequences holding a batch slot (prefilling or decoding).",
            value=s.active_sequences,
        )
        paged = s.storage_backend == "paged"
        yield GaugeMetricFamily(
            "mlxserve_kv_blocks_in_use",
            "KV cache blocks held by running sequences (paged storage; 0 for dense).",
            value=s.active_blocks if paged else 0,
        )
        yield GaugeMetricFamily(
            "mlxserve_kv_cache_used_bytes",
            "Bytes of KV cache holding running sequences' tokens.",
            value=s.used_bytes,
        )
        yield GaugeMetricFamily(
            "mlxserve_prefix_cache_hit_ratio",
            "Prefix-cache hits / lookups since start (0 before any lookup).",
            value=s.prefix_hits / s.prefix_lookups if s.prefix_lookups else 0.0,
        )


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` series: they only add noise to a scrape
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.generated_tokens = Counter(
            "mlxserve_generated_tokens", "Tokens generated and delivered.", registry=r
        )
        self.requests = Counter(
            "mlxserve_requests",
            "Requests that ran in the scheduler, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.rejections = Counter(
            "mlxserve_rejections",
            "Requests refused before queueing, by reason.",
            ["reason"],
            registry=r,
        )
        self.preemptions = Counter(
            "mlxserve_preemptions", "Running sequences evicted for a higher priority.", registry=r
        )
        self.ttft = Histogram(
            "mlxserve_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mlxserve_inter_token_latency_seconds",
            "Time between consecutive tokens of a request, as delivered to its RPC.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        for reason in FINISH_REASONS:  # export zeros, so rate() works from the first request
            self.requests.labels(reason)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        self._server: Any = None

    def watch_runtime(self, cache_stats: Callable[[], Any]) -> None:
        self.registry.register(_CacheStatsCollector(cache_stats))

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics over HTTP from a daemon thread."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
