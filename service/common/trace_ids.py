"""Trace ids in structlog lines.

A request's log lines come from two places: its RPC's asyncio task, where the RPC span is the
current OpenTelemetry span, and the scheduler thread (e.g. "request finished"), where no span is
current. The servicer registers each traced request's ids here when its RPC starts, and the
processor adds `trace_id` / `span_id` to any line that names a registered `request_id`, or else to
any line logged while a valid span is current. A request that ended in the scheduler is dropped
when its RPC ends; one whose RPC ended first (cancelled) stays until the scheduler's own lines
about it are written, then ages out of a bounded table.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Any

MAX_LINGERING = 1024  # ids of cancelled requests kept for the scheduler's late lines

_ids_by_request: dict[str, tuple[str, str]] = {}
_lingering: OrderedDict[str, tuple[str, str]] = OrderedDict()
_lock = threading.Lock()
_tracing_on = False


def register(request_id: str, ids: tuple[str, str]) -> None:
    with _lock:
        _lingering.pop(request_id, None)
        _ids_by_request[request_id] = ids


def unregister(request_id: str, linger: bool = False) -> None:
    """Forget a request's ids; with `linger`, keep them a while for lines still to come."""
    with _lock:
        ids = _ids_by_request.pop(request_id, None)
        if linger and ids is not None:
            _lingering[request_id] = ids
            while len(_lingering) > MAX_LINGERING:
                _lingering.popitem(last=False)


def _lookup(request_id: Any) -> tuple[str, str] | None:
    if request_id is None:
        return None
    return _ids_by_request.get(request_id) or _lingering.get(request_id)


def enable_current_span_lookup() -> None:
    """Look at the current OTel span too (only once tracing is configured: with it off, every
    span is invalid and the processor skips the look-up)."""
    global _tracing_on
    _tracing_on = True


def add_trace_ids(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
    """structlog processor: `trace_id` and `span_id` (hex) for the request's span."""
    if "trace_id" in event:
        return event
    ids = _lookup(event.get("request_id")) if _ids_by_request or _lingering else None
    if ids is None and _tracing_on:
        from service.frontend.telemetry.tracing import current_span, span_ids

        ids = span_ids(current_span())
    if ids is not None:
        event["trace_id"], event["span_id"] = ids
    return event
